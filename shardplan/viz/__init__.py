"""The plan visualizer: terminal (``shardplan show``) and a self-contained HTML report."""
