"""bench/prefill_bench.py without a GPU: manifest reading and checking, case selection, the
long-prompt chunks, weighted totals per stratum, the tables, the chart and the arguments. The
timed part needs PyTorch with CUDA; here it must refuse with exit code 2."""

import json
import pathlib

import pytest

import bench_scripts

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED_DATA = ROOT.parent / "shared" / "data"


pb = bench_scripts.load("prefill_bench")

ROWS = [
    {"case_id": "prefill_aaaa1111bbbb2222cccc", "tags": ["representative"], "representative_weight": 30,
     "stratum": "b1/t1_3/k_le_32k", "count": 1, "batch_size": 1, "query_lens": [5], "prefix_lens": [300],
     "final_kv_lens": [305]},
    {"case_id": "prefill_dddd3333eeee4444ffff", "tags": ["representative", "hot"], "representative_weight": 10,
     "stratum": "b2/t1_3/k_le_32k", "count": 4, "batch_size": 2, "query_lens": [3, 4], "prefix_lens": [2048, 256],
     "final_kv_lens": [2051, 260]},
    {"case_id": "prefill_0000555566667777", "tags": ["hot"], "representative_weight": None, "stratum": None,
     "count": 7, "batch_size": 1, "query_lens": [2], "prefix_lens": [0], "final_kv_lens": [2]},
]


def write_manifest(path, rows, blank_after=None):
    lines = []
    for i, row in enumerate(rows):
        lines.append(row if isinstance(row, str) else json.dumps(row))
        if blank_after == i:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_rows_shapes_and_weights(tmp_path):
    cases, any_tags = pb.read_manifest(write_manifest(tmp_path / "m.jsonl", ROWS, blank_after=1))
    assert any_tags and len(cases) == 3
    a, b, c = cases
    assert (a.batch, a.total_q, a.max_kv, a.pages, a.short_id) == (1, 5, 305, 3, "aaaa1111")
    assert (b.batch, b.total_q, b.kv_lens, b.max_kv, b.pages) == (2, 7, [2051, 260], 2051, 17 + 3)
    # Line numbers count the blank line.
    assert [x.line for x in cases] == [1, 2, 4]
    # representative_weight; null = 0 (a diagnostic row); no stratum = "".
    assert [x.weight for x in cases] == [30.0, 10.0, 0.0]
    assert c.stratum == "" and c.tags == ["hot"]


def test_weight_without_the_field_is_the_count_else_one():
    assert pb.weight_of({"count": 11}) == 11.0
    assert pb.weight_of({}) == 1.0
    assert pb.weight_of({"representative_weight": 2.5, "count": 11}) == 2.5
    assert pb.weight_of({"representative_weight": None, "count": 11}) == 0.0
    with pytest.raises(pb.ManifestError, match="representative_weight must be a number >= 0 or null, got -1"):
        pb.weight_of({"representative_weight": -1})


def test_a_row_without_case_id_is_named_by_its_line(tmp_path):
    cases, any_tags = pb.read_manifest(write_manifest(tmp_path / "m.jsonl", [
        {"batch_size": 1, "query_lens": [7], "prefix_lens": [200]}]))
    assert not any_tags
    assert cases[0].case_id == "line 1" and cases[0].short_id == "line 1" and cases[0].weight == 1.0


@pytest.mark.parametrize("row, message", [
    ('{"batch_size":1,"query_lens":[5],', r"line 2 is not valid JSON"),
    ("[1, 2]", r"line 2: expected a JSON object"),
    ({"query_lens": [5], "prefix_lens": [3]}, r"line 2: field 'batch_size' is missing"),
    ({"batch_size": 2, "query_lens": [5], "prefix_lens": [3, 1]},
     r"line 2: query_lens must have batch_size = 2 entries, got 1"),
    ({"batch_size": 1, "query_lens": [5], "prefix_lens": [300], "final_kv_lens": [306]},
     r"line 2: final_kv_lens\[0\] = 306 must equal prefix_lens\[0\] \+ query_lens\[0\] = 305"),
    ({"batch_size": 1, "query_lens": [0], "prefix_lens": [3]}, r"line 2: query_lens\[0\] must be in \[1, 1048576\], got 0"),
    ({"batch_size": 1, "query_lens": [5.0], "prefix_lens": [3]}, r"line 2: query_lens\[0\] must be an integer, got 5.0"),
    ({"batch_size": 1, "query_lens": [True], "prefix_lens": [3]}, r"query_lens\[0\] must be an integer, got true"),
    ({"batch_size": 1, "query_lens": [5], "prefix_lens": [-1]}, r"prefix_lens\[0\] must be in \[0, 1048576\]"),
    ({"batch_size": 1, "query_lens": [5], "prefix_lens": [1048576]}, r"= 1048581 exceeds 1048576 tokens"),
    ({"batch_size": 1, "query_lens": [5], "prefix_lens": [3], "tags": "hot"}, r"tags must be an array of strings"),
    ({"batch_size": 1, "query_lens": [5], "prefix_lens": [3], "stratum": 4}, r"stratum must be a string or null"),
])
def test_unusable_rows_name_the_line_and_field(tmp_path, row, message):
    path = write_manifest(tmp_path / "bad.jsonl", [ROWS[0], row])
    with pytest.raises(pb.ManifestError, match=message) as e:
        pb.read_manifest(path)
    assert str(e.value).startswith(path)


def test_missing_empty_and_folder_manifests(tmp_path):
    with pytest.raises(pb.ManifestError, match="cannot be read"):
        pb.read_manifest(str(tmp_path / "absent.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(pb.ManifestError, match="the manifest has no rows"):
        pb.read_manifest(str(tmp_path / "empty.jsonl"))
    with pytest.raises(pb.ManifestError, match="is a directory"):
        pb.read_manifest(str(tmp_path))


def test_case_selection(tmp_path):
    cases, any_tags = pb.read_manifest(write_manifest(tmp_path / "m.jsonl", ROWS))
    chosen, label = pb.select_cases(cases, any_tags)
    assert [c.line for c in chosen] == [1, 2] and label == "representative (2 of 3 rows)"
    chosen, label = pb.select_cases(cases, any_tags, "hot")
    assert [c.line for c in chosen] == [2, 3] and label == "hot (2 of 3 rows)"
    chosen, label = pb.select_cases(cases, any_tags, "all")
    assert len(chosen) == 3 and label == "all (3 of 3 rows)"
    with pytest.raises(pb.ManifestError, match=r"--cases stress: no row of .* is tagged 'stress' \(its tags: hot, "
                                               r"representative\)"):
        pb.select_cases(cases, any_tags, "stress", str(tmp_path / "m.jsonl"))
    # Without tags the default is every row; asking for a tag says there are none.
    untagged = [pb.Case("x", [1], [0]), pb.Case("y", [2], [5])]
    chosen, label = pb.select_cases(untagged, False)
    assert len(chosen) == 2 and label == "all (2 of 2 rows, the manifest has no tags)"
    with pytest.raises(pb.ManifestError, match="its rows have no tags; --cases all times every row"):
        pb.select_cases(untagged, False, "representative")


def test_long_prompt_chunks():
    chunks = pb.long_chunks(1280, 256, 2)
    assert [(c.chunk, c.prefix_lens[0], c.query_lens[0], c.weight) for c in chunks] == [
        (0, 0, 256, 2.0), (2, 512, 256, 2.0), (4, 1024, 256, 1.0)]
    # Every chunk, and the chunks they stand for add up to the prompt.
    every = pb.long_chunks(1000, 256, 1)
    assert [(c.prefix_lens[0], c.query_lens[0], c.weight) for c in every] == [
        (0, 256, 1.0), (256, 256, 1.0), (512, 256, 1.0), (768, 232, 1.0)]
    for tokens, chunk, sample in [(1 << 20, 16384, 5), (1 << 20, 16384, 8), (100_000, 4096, 3), (5, 16, 4)]:
        cases = pb.long_chunks(tokens, chunk, sample)
        count = -(-tokens // min(chunk, tokens))
        assert sum(c.weight for c in cases) == count
        assert all(c.batch == 1 and c.kv_lens[0] <= tokens for c in cases)
    # An odd group times its middle chunk, an even one the lower of the two middle ones.
    assert [c.chunk for c in pb.long_chunks(1 << 20, 16384, 5)][:3] == [2, 7, 12]
    assert [c.chunk for c in pb.long_chunks(1 << 20, 16384, 8)][:3] == [3, 11, 19]
    # A sample larger than the prompt: one timed chunk for all of it.
    (only,) = pb.long_chunks(4096, 1024, 100)
    assert (only.chunk, only.weight) == (1, 4.0)


def test_parse_long():
    assert pb.parse_long("1m:16k") == (1 << 20, 16384, 1)
    assert pb.parse_long("1048576:16384:5") == (1 << 20, 16384, 5)
    for text, message in [("1m", "must be N:C or N:C:K"), ("1m:16k:5:1", "must be N:C or N:C:K"),
                          ("2m:16k", r"N must be in \[1, 1048576\]"), ("x:16k", "N must be a token count"),
                          ("1m:0", r"C must be in \[1, 1048576\]"), ("1m:16k:0", "K must be an integer"),
                          ("1m:16k:x", "K must be an integer")]:
        with pytest.raises(pb.ManifestError, match=message):
            pb.parse_long(text)


def result(case, cache, msa_ms, dense_ms, indexer_ms=0.0):
    return dict(case=case, cache=cache, msa_ms=msa_ms, indexer_ms=indexer_ms,
                indexer_share=indexer_ms / msa_ms, dense_ms=dense_ms, dense_backend="flash" if dense_ms else None,
                speedup=dense_ms / msa_ms if dense_ms else None)


def test_weighted_totals_per_stratum():
    a = pb.Case("a", [5], [300], stratum="s1", weight=30)
    b = pb.Case("b", [3, 4], [2048, 256], stratum="s2", weight=10)
    c = pb.Case("c", [2], [0], stratum="s2", weight=0)  # a diagnostic row: no weight
    results = [result(a, "bf16", 2.0, 1.0), result(b, "bf16", 1.0, 8.0), result(c, "bf16", 1.0, 0.5),
               result(a, "fp8", 1.0, 1.0), result(b, "fp8", 0.5, 8.0), result(c, "fp8", 1.0, None)]
    rows = {(t["stratum"], t["cache"]): t for t in pb.totals(results)}
    assert list(rows) == [("s1", "bf16"), ("s2", "bf16"), ("all", "bf16"), ("s1", "fp8"), ("s2", "fp8"), ("all", "fp8")]
    s1 = rows["s1", "bf16"]
    assert (s1["cases"], s1["weight"], s1["weighted_msa_ms"], s1["weighted_dense_ms"]) == (1, 30, 60.0, 30.0)
    assert s1["speedup"] == pytest.approx(0.5) and s1["slower"] == 1
    total = rows["all", "bf16"]
    assert (total["cases"], total["weight"]) == (3, 40)
    assert total["weighted_msa_ms"] == pytest.approx(30 * 2 + 10 * 1)
    assert total["speedup"] == pytest.approx((30 * 1 + 10 * 8) / (30 * 2 + 10 * 1))
    assert total["slower"] == 2 and total["without_dense"] == 0  # a and c are slower than dense
    # A row without a dense time counts in the msa sum, not in the speed-up.
    fp8 = rows["all", "fp8"]
    assert fp8["without_dense"] == 1 and fp8["weighted_msa_ms"] == pytest.approx(30 + 5 + 0)
    assert fp8["speedup"] == pytest.approx((30 * 1 + 10 * 8) / (30 * 1 + 10 * 0.5))


def test_totals_without_strata_and_of_a_long_prompt():
    rows = pb.totals([result(pb.Case("a", [5], [0]), "bf16", 1.0, 2.0), result(pb.Case("b", [5], [9]), "bf16", 1.0, 3.0)])
    assert [(t["stratum"], t["cases"], t["speedup"]) for t in rows] == [("all", 2, 2.5)]
    chunks = pb.long_chunks(1280, 256, 2)
    rows = pb.totals([result(c, "bf16", 1.0 + c.chunk, 4.0) for c in chunks], long_prompt=True)
    (total,) = rows
    assert total["weight"] == 5 and total["weighted_msa_ms"] == pytest.approx(2 * 1 + 2 * 3 + 1 * 5)
    assert total["weighted_dense_ms"] == pytest.approx(20.0)


def test_tables():
    a = pb.Case("prefill_aaaa1111bbbb2222cccc", [5], [300], stratum="s1", weight=30)
    results = [result(a, "bf16", 2.0, 1.0, indexer_ms=0.5)]
    text = pb.result_table(results, long_prompt=False)
    header, rule, row = text.splitlines()
    assert header.split() == ["case", "stratum", "weight", "batch", "queries", "max", "kv", "cache", "msa", "ms", "idx",
                              "%", "dense", "ms", "dense", "backend", "speed-up"]
    assert set(rule) == {"-"}
    assert row.split() == ["aaaa1111", "s1", "30", "1", "5", "305", "bf16", "2.000", "25.0", "1.000", "flash", "0.50x"]
    totals = pb.totals_table(pb.totals(results), long_prompt=False)
    assert "sum w*dense ms" in totals and totals.splitlines()[-1].split() == [
        "all", "bf16", "1", "30", "60.000", "30.000", "0.50x", "1"]
    long_text = pb.result_table([result(c, "fp8", 1.0, 2.0) for c in pb.long_chunks(1280, 256, 2)], long_prompt=True)
    assert long_text.splitlines()[0].split()[:4] == ["chunk", "prefix", "queries", "stands"]
    assert long_text.splitlines()[3].split()[:5] == ["2", "512", "256", "2", "fp8"]


def test_chart(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    a = pb.Case("a", [5], [300], stratum="s1", weight=30)
    b = pb.Case("b", [5], [3000], stratum="s2", weight=3)
    results = [result(a, "bf16", 2.0, 1.0), result(b, "bf16", 1.0, 30.0), result(a, "fp8", 1.0, 1.0),
               result(b, "fp8", 1.0, None)]
    path = tmp_path / "speedup.png"
    pb.draw_chart(pb.totals(results), str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    chunks = pb.long_chunks(1280, 256, 2)
    long_path = tmp_path / "long.png"
    long_results = [result(c, "bf16", 1.0, 2.0 + c.chunk) for c in chunks]
    pb.draw_chart(pb.totals(long_results, True), str(long_path), "long", long_results, long_prompt=True)
    assert long_path.read_bytes()[:4] == b"\x89PNG"


def test_arguments(tmp_path, capsys):
    args = pb.parse_args(["m.jsonl", "--cases", "hot", "--formats", "fp8,bf16,fp8", "--reps", "3"])
    assert (args.manifest, args.cases, args.formats, args.reps, args.warmup) == ("m.jsonl", "hot", ["fp8", "bf16"], 3, 3)
    args = pb.parse_args(["--long", "1m:16k:5", "--json", str(tmp_path / "r.json"), "--chart", str(tmp_path / "c.png")])
    assert args.long == "1m:16k:5" and args.manifest is None and args.formats == ["bf16", "fp8"]
    for argv, message in [([], "give a manifest or --long"), (["m.jsonl", "--long", "1m:16k"], "one of them"),
                          (["--long", "1m:16k", "--cases", "all"], "--cases selects manifest rows"),
                          (["m.jsonl", "--formats", "nvfp4"], "bf16, fp8, got 'nvfp4'"),
                          (["m.jsonl", "--reps", "0"], "--reps must be at least 1"),
                          (["m.jsonl", "--warmup", "-1"], "--warmup must be at least 0"),
                          (["m.jsonl", "--json", str(tmp_path / "no" / "r.json")], "--json: the folder"),
                          (["m.jsonl", "--chart", "no/such/dir/c.png"], "--chart: the folder")]:
        with pytest.raises(SystemExit) as e:
            pb.parse_args(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_main_checks_the_manifest_before_anything_else(tmp_path, capsys):
    path = write_manifest(tmp_path / "bad.jsonl", [{"batch_size": 2, "query_lens": [5], "prefix_lens": [3, 1]}])
    assert pb.main([path]) == 2
    assert "bad.jsonl: line 1: query_lens must have batch_size = 2 entries" in capsys.readouterr().err
    assert pb.main(["--long", "1m:16k:0"]) == 2
    assert "K must be an integer" in capsys.readouterr().err


def test_without_cuda_the_script_exits_2(tmp_path, capsys):
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("a CUDA device is usable: the benchmark would run")
    path = write_manifest(tmp_path / "m.jsonl", ROWS)
    assert pb.main([path]) == 2
    err = capsys.readouterr().err
    assert "PyTorch is not installed" in err or "no CUDA device" in err


def test_the_bundled_manifest():
    # bench/data's copy of the benchmark-case set: 66 representative rows whose weights add up
    # to every recorded call, one stratum each.
    cases, any_tags = pb.read_manifest(str(ROOT / "bench" / "data" / "prefill_benchmark_cases.jsonl"))
    chosen, _ = pb.select_cases(cases, any_tags)
    assert len(cases) == 128 and len(chosen) == 66
    assert sum(c.weight for c in chosen) == 14805 and sum(c.weight for c in cases) == 14805
    assert len({c.stratum for c in chosen}) == 66


@pytest.mark.skipif(not (SHARED_DATA / "prefill_shapes.jsonl").exists(), reason="shared/data is not beside the repository")
def test_the_shape_manifest():
    # The shape manifest has no tags: every row, weighted by its call count.
    shapes, any_tags = pb.read_manifest(str(SHARED_DATA / "prefill_shapes.jsonl"))
    rows = [json.loads(line) for line in (SHARED_DATA / "prefill_shapes.jsonl").read_text().splitlines() if line]
    chosen, label = pb.select_cases(shapes, any_tags)
    assert not any_tags and len(chosen) == len(rows) and "no tags" in label
    assert [c.weight for c in chosen] == [float(r["count"]) for r in rows]


def test_the_whole_path_on_the_cpu(tmp_path, capsys):
    """--device cpu: the manifest through msa's CPU backend and PyTorch's CPU SDPA, every table
    and file written (times are wall clock; the numbers are not checked)."""
    pytest.importorskip("torch", reason="PyTorch is not installed")
    path = write_manifest(tmp_path / "m.jsonl", [ROWS[0], dict(ROWS[1], query_lens=[3, 2], final_kv_lens=[2051, 258])])
    report = tmp_path / "r.json"
    assert pb.main([path, "--device", "cpu", "--reps", "1", "--warmup", "0", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "prefill step on cpu" in out and "cases: representative (2 of 2 rows)" in out
    assert len([line for line in out.splitlines() if line.startswith(("aaaa1111 ", "dddd3333 "))]) == 4
    data = json.loads(report.read_text())
    assert [(r["case_id"][8:16], r["cache"]) for r in data["results"]] == [
        ("aaaa1111", "bf16"), ("aaaa1111", "fp8"), ("dddd3333", "bf16"), ("dddd3333", "fp8")]
    for r in data["results"]:
        assert r["msa_ms"] > 0 and 0 < r["indexer_share"] < 1
        assert r["plan_host_ms"] > 0
        assert r["dense_ms"] is None or (r["dense_ms"] > 0 and r["speedup"] > 0)
    assert [(t["stratum"], t["cache"]) for t in data["totals"]] == [
        ("b1/t1_3/k_le_32k", "bf16"), ("b2/t1_3/k_le_32k", "bf16"), ("all", "bf16"),
        ("b1/t1_3/k_le_32k", "fp8"), ("b2/t1_3/k_le_32k", "fp8"), ("all", "fp8")]
    # A long prompt, every second chunk's worth.
    assert pb.main(["--long", "768:256:2", "--device", "cpu", "--formats", "bf16", "--reps", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "long prompt: 768 tokens in chunks of 256 (3 chunks); 2 of 3 chunks timed" in out


def test_replot_draws_the_chart_of_a_saved_report(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    report = {"device_name": "test GPU",
              "totals": [{"stratum": "b1/t1_3/k_le_32k", "cache": "bf16", "speedup": 2.0},
                         {"stratum": "all", "cache": "bf16", "speedup": 3.5}]}
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    png = tmp_path / "replot.png"
    assert pb.main(["--replot", str(saved), "--chart", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_refuses_what_it_cannot_draw(tmp_path, capsys):
    for argv in (["--replot", "r.json"], ["--replot", "r.json", "--chart", str(tmp_path / "c.png"), "m.jsonl"]):
        with pytest.raises(SystemExit):
            pb.parse_args(argv)
        assert "--replot JSON draws --chart PNG" in capsys.readouterr().err
    long_report = tmp_path / "long.json"
    long_report.write_text(json.dumps({"totals": [], "long_prompt": {"tokens": 1}}))
    with pytest.raises(SystemExit, match="--long report"):
        pb.main(["--replot", str(long_report), "--chart", str(tmp_path / "c.png")])
    with pytest.raises(SystemExit, match="not a manifest report"):
        pb.main(["--replot", str(tmp_path / "missing.json"), "--chart", str(tmp_path / "c.png")])
