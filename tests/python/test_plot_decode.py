"""bench/plot_decode.py without a GPU: reading `msa bench --decode --json` reports and drawing."""

import json

import pytest

import bench_scripts

pd = bench_scripts.load("plot_decode")


def part(percent):
    return {"us": 10.0, "bytes": 1000, "gb_per_s": 100.0, "percent_of_copy": percent}


def report(tmp_path, name="decode.json", **changes):
    data = {"bench": "decode", "results": [
        {"batch": 8, "context": 4096, "queries_per_request": 8, "cache": "bf16", "splits": 4,
         "indexer": part(8.0), "attention": part(10.0), "step": part(9.5)},
        {"batch": 128, "context": 131072, "queries_per_request": 1, "cache": "fp8", "splits": 1,
         "indexer": part(56.0), "attention": part(23.0), "step": part(48.0)}]}
    data.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_rows_are_labelled_by_shape_and_keep_the_report_order(tmp_path):
    rows = pd.read_rows(str(report(tmp_path)))
    assert [label for label, _ in rows] == ["8 x 4k, Q 8, bf16", "128 x 128k, Q 1, fp8"]
    assert rows[1][1] == {"indexer": 56.0, "attention": 23.0, "step": 48.0}


def test_the_cuda_graph_step_is_read_when_the_report_has_it(tmp_path):
    path = report(tmp_path)
    data = json.loads(path.read_text())
    data["results"][0]["step_graph"] = part(30.0)
    path.write_text(json.dumps(data))
    rows = pd.read_rows(str(path))
    assert rows[0][1]["step_graph"] == 30.0 and "step_graph" not in rows[1][1]


def test_what_is_not_a_decode_report_is_refused_naming_the_file(tmp_path):
    with pytest.raises(SystemExit, match="not 'decode'"):
        pd.read_rows(str(report(tmp_path, bench="prefill")))
    with pytest.raises(SystemExit, match="no results"):
        pd.read_rows(str(report(tmp_path, results=[])))
    with pytest.raises(SystemExit, match="missing.json"):
        pd.read_rows(str(tmp_path / "missing.json"))


def test_chart_of_two_reports(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    out = tmp_path / "decode.png"
    assert pd.main([str(report(tmp_path, "a.json")), str(report(tmp_path, "b.json")), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pd.main([str(report(tmp_path)), "--out", str(tmp_path / "no" / "such" / "x.png")])
