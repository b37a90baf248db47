"""Command-line interface: ``shardplan <subcommand>``."""
