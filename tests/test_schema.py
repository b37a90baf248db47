"""The schema toolkit (shardplan/_schema.py): frozen mappings, typed field checks, unknown keys
with a did-you-mean, and frozen dataclasses built from mappings. Messages are checked whole:
the cluster, plan, planner, data and run-config readers all word theirs through it."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

from shardplan._schema import (
    FrozenMap,
    Where,
    as_float,
    as_int,
    as_mapping,
    as_str,
    build,
    check_choice,
    check_keys,
    conform,
    invalid,
    natural_key,
    options_from_mapping,
    reject_unknown_kwargs,
    require,
)
from shardplan.errors import ClusterError, ConfigError, PlanMismatchError

SCHEMA = Path(__file__).resolve().parents[1] / "shardplan" / "_schema.py"


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = 0.5


@dataclasses.dataclass(frozen=True)
class Outer:
    steps: int
    name: str | None = None
    sizes: tuple[int, ...] = ()
    inner: Inner = dataclasses.field(default_factory=Inner)


@dataclasses.dataclass(frozen=True)
class Options:
    time_limit_s: float = 30.0
    schedules: tuple[str, ...] = ("gpipe",)


def test_the_toolkit_imports_only_the_standard_library_and_the_errors() -> None:
    tree = ast.parse(SCHEMA.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    ours = {m for m in modules if m.split(".")[0] == "shardplan"}
    assert ours <= {"shardplan.errors", "shardplan._files"}
    assert not {m for m in modules if m.split(".")[0] in ("jax", "yaml", "numpy")}


def test_a_frozen_map_iterates_in_natural_order_and_equals_any_equal_mapping() -> None:
    m = FrozenMap({"blocks/10": 1, "blocks/2": 2, "a": 3})
    assert list(m) == ["a", "blocks/2", "blocks/10"]
    assert m == {"blocks/10": 1, "blocks/2": 2, "a": 3}
    assert hash(m) == hash(FrozenMap([("a", 3), ("blocks/2", 2), ("blocks/10", 1)]))
    assert sorted([3, 1, 2], key=natural_key) == [1, 2, 3]


def test_a_frozen_map_may_keep_the_order_it_was_given() -> None:
    given = FrozenMap({"fp32": 1.0, "bf16": 2.0}, sort=False)
    assert list(given) == ["fp32", "bf16"]
    assert given == FrozenMap({"bf16": 2.0, "fp32": 1.0})
    assert hash(given) == hash(FrozenMap({"bf16": 2.0, "fp32": 1.0}))


def test_a_frozen_map_survives_pickling_with_its_order() -> None:
    for m in (FrozenMap({"b": 1, "a": 2}), FrozenMap({"b": 1, "a": 2}, sort=False)):
        back = pickle.loads(pickle.dumps(m))
        assert back == m and list(back) == list(m) and repr(back) == repr(m)


def test_a_frozen_map_cannot_be_changed() -> None:
    m = FrozenMap({"a": 1})
    with pytest.raises(TypeError):
        m["a"] = 2  # type: ignore[index]
    with pytest.raises(AttributeError):
        m.extra = 1  # type: ignore[attr-defined]


def test_an_unknown_key_is_named_with_the_closest_known_one() -> None:
    where = Where("c.yaml", "groups[0]", {"groups[0]": 4})
    with pytest.raises(ClusterError) as err:
        check_keys({"nodse": 1}, where, allowed=("nodes", "device"), error=ClusterError)
    assert str(err.value) == (
        "unknown key 'nodse'\n"
        "  where: groups[0].nodse (c.yaml, line 4)\n"
        "  value: 'nodse'\n"
        "  fix:   did you mean 'nodes'? Allowed keys here: nodes, device")


def test_a_missing_required_key_names_its_remedy() -> None:
    with pytest.raises(ConfigError, match="missing required key 'nodes'") as err:
        check_keys({}, Where(path="g"), allowed=("nodes",), required=("nodes",),
                   remedies={"nodes": "add 'nodes: 1'"})
    assert "fix:   add 'nodes: 1'" in str(err.value)


def test_typed_getters_name_the_key_path_and_what_the_number_means() -> None:
    where = Where(path="intra_node.bandwidth_GB_s")
    with pytest.raises(ConfigError) as err:
        as_float("300", where, what="a bandwidth in GB/s")
    assert str(err.value).splitlines() == [
        "expected a bandwidth in GB/s, got a string",
        "  where: intra_node.bandwidth_GB_s",
        "  value: '300'",
        "  fix:   write a bandwidth in GB/s as a plain number without quotes (312e12, 3.12e14 "
        "and 312_000 all parse as numbers)"]
    with pytest.raises(ConfigError, match=r"must be a finite number >= 0"):
        as_float(float("inf"), where, what="a latency", allow_minimum=True)
    assert as_int(80e9, where, what="memory") == 80_000_000_000
    with pytest.raises(ConfigError, match=r"expected a node count \(a whole number\), got bool"):
        as_int(True, where, what="a node count")
    with pytest.raises(ConfigError, match="a node count must be >= 1"):
        as_int(0, where, what="a node count")
    with pytest.raises(ConfigError, match="non-empty string"):
        as_str("  ", where, what="a name")
    with pytest.raises(ConfigError, match="keys must be strings, got int"):
        as_mapping({1: 2}, where, what="a link")


def test_a_long_value_from_a_file_is_cut_in_the_message() -> None:
    with pytest.raises(ConfigError) as err:
        as_int(list(range(100)), Where(path="nodes"), what="a node count")
    value = next(line for line in str(err.value).splitlines() if line.startswith("  value:"))
    assert value.endswith(" ...)") and len(value) < 180


def test_a_choice_suggests_the_closest_and_lists_them_all() -> None:
    with pytest.raises(ConfigError) as err:
        check_choice("FULL", ("none", "selective", "full"), where="stages[0].remat",
                     what="remat policy")
    assert str(err.value) == (
        "Unknown remat policy 'FULL'.\n"
        "  where: stages[0].remat\n"
        "  value: 'FULL'\n"
        "  fix:   did you mean 'full'? one of: none, selective, full")
    with pytest.raises(ConfigError, match="fix:   sources: builtin, text"):
        check_choice(None, ("builtin", "text"), where="data.source", what="data source",
                     label="sources", match=str)
    assert check_choice("full", ("full",), where="w", what="x") == "full"


def test_require_words_the_check_as_its_caller_does() -> None:
    require(True, "train.steps", 0, "an integer >= 1")
    with pytest.raises(ConfigError) as err:
        require(False, "data.seq_len", None, "an integer >= 1", subject="DataConfig.seq_len")
    assert str(err.value) == (
        "DataConfig.seq_len must be an integer >= 1.\n"
        "  where: data.seq_len\n"
        "  value: None\n"
        "  fix:   give an integer >= 1")
    with pytest.raises(ConfigError) as err:
        require(False, "PlanConfig.chunks", None, "integers >= 2", verb="pass", show_none=False)
    assert "value:" not in str(err.value) and "fix:   pass integers >= 2" in str(err.value)


def test_an_error_class_is_the_callers() -> None:
    error = invalid("A mesh needs one size per axis name.", where="MeshSpec", value=(2,),
                    remedy="give one size per axis", error=PlanMismatchError)
    assert isinstance(error, PlanMismatchError)
    assert str(error).splitlines()[2] == "  value: (2,)"


def test_conform_takes_lists_for_tuples_and_ints_for_floats_but_no_bools() -> None:
    assert conform([1, 2], tuple[int, ...]) == (True, (1, 2))
    assert conform(3, float) == (True, 3.0)
    assert conform(True, int) == (False, True)
    assert conform(None, float | None) == (True, None)
    assert conform("x", float | None) == (False, "x")
    assert conform([1], tuple[int, int]) == (False, [1])


def test_a_dataclass_is_built_from_a_mapping_field_by_field() -> None:
    built = build(Outer, {"steps": 3, "sizes": [1, 2], "inner": {"rate": "3e-4"}}, "run")
    assert built == Outer(steps=3, sizes=(1, 2), inner=Inner(rate=3e-4))


def test_building_names_the_key_path_of_a_wrong_or_missing_value() -> None:
    with pytest.raises(ConfigError) as err:
        build(Outer, {"steps": 3, "inner": {"rate": "fast"}}, "run")
    assert str(err.value) == (
        "run.inner.rate must be of type float, not str.\n"
        "  where: run.inner.rate\n"
        "  value: 'fast'\n"
        "  fix:   give a value of type float (YAML: quote strings, write numbers bare)")
    with pytest.raises(ConfigError, match=r"`run` is missing the key 'steps'\."):
        build(Outer, {}, "run")
    with pytest.raises(ConfigError, match=r"did you mean 'steps'\? keys here: steps, name"):
        build(Outer, {"step": 3}, "run")


def test_options_of_a_config_class_name_it_as_their_owner() -> None:
    assert options_from_mapping(Options, {"schedules": ["1f1b"]}, where="plan",
                                noun="plan config") == {"schedules": ("1f1b",)}
    with pytest.raises(ConfigError) as err:
        options_from_mapping(Options, {"time_limit": 1}, where="plan", noun="plan config")
    assert str(err.value).splitlines()[0] == "Options has no option 'time_limit'."
    assert "did you mean 'time_limit_s'?" in str(err.value)
    with pytest.raises(ConfigError, match="Options option 'time_limit_s' must be of type float"):
        options_from_mapping(Options, {"time_limit_s": "x"}, where="plan", noun="plan config")
    with pytest.raises(ConfigError, match="A plan config must be a mapping of option names"):
        options_from_mapping(Options, [1], where="plan", noun="plan config")
    with pytest.raises(ConfigError, match=r"where: Options\(time_limt_s=\.\.\.\)"):
        reject_unknown_kwargs(Options, {"time_limt_s": 1})
