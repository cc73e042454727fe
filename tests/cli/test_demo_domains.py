"""scripts/demo.py's domains and the demo's answer-check table, without training anything."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_demo():
    """scripts/demo.py as a module; it puts the repository and scripts/ first on sys.path to import its sibling
    demo_report, which this undoes afterwards."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("fedmoe_demo", ROOT / "scripts" / "demo.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module, sys.modules["demo_report"]
    finally:
        sys.path[:] = saved


demo, report = _import_demo()


def test_the_smollm2_demo_trains_three_python_libraries_and_sql():
    domains = demo.DATASETS[demo.PRESETS["smollm2"].data]()
    assert [d.specialty for d in domains] == ["numpy_expert", "pandas_expert", "sklearn_expert", "sql_expert"]
    sql = domains[-1]
    assert sql.train == ROOT / "data" / "spider" / "train" / "sql_expert.jsonl" and len(sql.heldout) == 106
    assert [d.specialty for d in demo.DATASETS["ds1000"]()] == ["numpy_expert", "pandas_expert", "sklearn_expert"]


def test_spider_held_out_prompts_find_their_schema_and_other_prompts_do_not():
    sql = demo.spider_domain()
    schemas = report.schemas_of(sql.heldout[:3])
    assert schemas is not None and all(s.startswith("CREATE TABLE ") for s in schemas)
    assert report.schemas_of(demo.ds1000_domains()[0].heldout[:1]) is None
    assert report.harnesses_of(sql.heldout[:1]) is None


def test_the_check_table_shows_pass_at_1_compiled_sql_and_n_a_where_neither_applies(capsys):
    r = report.Report(pass_at_1={"base model": {"numpy_expert": (1, 8)}, "gateway": {"numpy_expert": (2, 8)}},
                      sql_compiles={"base model": {"sql_expert": (0, 8)}, "gateway": {"sql_expert": (5, 8)}})
    report.print_answer_checks(r, ["numpy_expert", "sql_expert", "docs_expert"])
    lines = capsys.readouterr().out.splitlines()
    assert any("pass@1: DS-1000's own test" in line and "compiles on its database's schema" in line for line in lines)
    assert [line.split() for line in lines if line.startswith(("base model", "gateway"))] == [
        ["base", "model", "1/8", "0/8", "n/a"], ["gateway", "2/8", "5/8", "n/a"]]
    assert any("can still be wrong" in line for line in lines)


def test_no_check_applies_prints_nothing(capsys):
    report.print_answer_checks(report.Report(), ["python_expert"])
    assert capsys.readouterr().out == ""
