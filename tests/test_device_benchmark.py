"""The device benchmark (benchmarks/device.py) at its CPU sizes: a row per (encoding, path, T) in its table,
finite times and a memory figure where a path ran, and a reason where it did not."""

import json
import math
import pathlib
import time

import jax
import pytest
from scripts import benchmark_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def device():
    with benchmark_script("device.py", "device_benchmark") as module:
        yield module


def _rows(table: str) -> dict[tuple[str, str, int], list[str]]:
    """The table's rows by (encoding, path, T): every line of a table but its header and rule."""
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or cells[0] == "T" or set(cells[0]) <= set("-:"):
            continue
        key = (cells[2], cells[3], int(cells[0].replace(",", "")))
        assert key not in rows, f"two rows for {key}"
        rows[key] = cells
    return rows


def _check_run(device, out: pathlib.Path, encodings, lengths) -> dict:
    """The written table and JSON agree with a run of ``encodings`` x every path x ``lengths`` on the CPU."""
    table = (out / "table.md").read_text()
    assert "bfloat16" in table and "jax 0." in table and "(cpu)" in table
    rows = _rows(table)
    assert set(rows) == {(e, p, n) for e in encodings for p in device.PATHS for n in lengths}
    for (encoding, path, _), cells in rows.items():
        fwd_ms, fwd_ratio, both_ms, both_ratio, memory_fwd, memory_both = cells[4:10]
        if path == "cudnn":  # no cuDNN on the CPU: skipped, saying so
            assert (fwd_ms, both_ms) == ("skipped", "skipped") and "no cuDNN on cpu" in cells[-1]
            continue
        for ms, memory in ((fwd_ms, memory_fwd), (both_ms, memory_both)):
            assert math.isfinite(float(ms.replace(",", ""))) and float(ms.replace(",", "")) > 0, cells
            assert memory.endswith(("MiB", "GiB")) and float(memory.split()[0]) > 0, cells
        assert fwd_ratio.endswith("×") and both_ratio.endswith("×"), cells  # over xla NoPE of the same run
        if (encoding, path) == ("nope", "xla"):
            assert (fwd_ratio, both_ratio) == ("1.00×", "1.00×")
    results = json.loads((out / "results.json").read_text())
    assert results["backend"] == "cpu" and results["dtype"] == "bfloat16"
    for row in results["rows"]:
        for mode in device.MODES:
            result = row[mode]
            if row["path"] == "cudnn":
                assert result["status"] == "skipped"
                continue
            assert result["status"] == "measured", (row["encoding"], row["path"], mode, result)
            assert result["finite"] and result["memory_bytes"] > 0 and len(result["runs"]) == 2
            if row["path"] != "blockwise":  # the same attention as the blockwise path's, in bfloat16
                assert result["relative_difference"] < 0.05, (row["encoding"], row["path"], mode, result)
    return results


def test_a_small_run_writes_a_row_per_encoding_path_and_length(device, tmp_path):
    device.main(["--tiny", "--encodings", "nope,alibi", "--lengths", "128", "--out", str(tmp_path)])
    _check_run(device, tmp_path, ["nope", "alibi"], [128])


@pytest.mark.slow  # every default encoding, two lengths: about 100 programs compiled (the test above stays)
def test_the_tiny_preset_writes_a_row_per_encoding_path_and_length(device, tmp_path):
    device.main(["--tiny", "--out", str(tmp_path)])
    results = _check_run(device, tmp_path, device.default_encodings(), [128, 256])
    assert {"nope", "rope", "alibi", "t5", "kerple-log", "kerple-power"} <= set(results["settings"]["encodings"])


def test_what_does_not_fit_the_budget_or_memory_is_printed_as_skipped(device, tmp_path):
    device.main(["--tiny", "--encodings", "alibi", "--lengths", "128", "--budget-seconds", "0", "--out", str(tmp_path)])
    rows = _rows((tmp_path / "table.md").read_text())
    assert set(rows) == {("alibi", path, 128) for path in device.PATHS}
    for (_, path, _), cells in rows.items():
        assert (cells[4], cells[6]) == ("skipped", "skipped")
        assert ("no cuDNN" if path == "cudnn" else "skipped: budget: predicted") in cells[-1]
    device.main(["--tiny", "--encodings", "alibi", "--lengths", "128", "--memory-gib", "1e-6", "--out", str(tmp_path)])
    rows = _rows((tmp_path / "table.md").read_text())
    assert all("memory: predicted" in cells[-1] for (_, path, _), cells in rows.items() if path != "cudnn")


def test_the_grid_starts_at_the_target_and_spreads(device):
    assert device.length_order([1024, 2048, 4096, 8192, 16384, 32768]) == [8192, 1024, 32768, 16384, 4096, 2048]
    assert device.length_order([128, 256]) == [256, 128]
    assert device.sizes(1024, 128, 16384, 2048) == (16, 16) and device.sizes(32768, 64, 16384, 2048) == (1, 32)


def test_the_default_encodings_are_nope_rope_and_what_the_pallas_kernels_take(device):
    from posenc_jax.functional.core.normalizers import softmax_weights
    from posenc_jax.functional.kernels import pallas_dispatch

    names = device.default_encodings()
    assert names[:4] == ["nope", "alibi", "t5", "rope"]
    for name in names[4:]:
        hooks = device.build_hooks(name, 256, 2, 64)
        assert pallas_dispatch.unsupported(hooks, softmax_weights, None, 0.0) is None, name
    assert "shaw" not in names and "rope-yarn" not in names  # neither is taken by the kernels as it is


def test_bad_arguments_are_refused_naming_them(device, capsys):
    for argv, named in (
        (["--paths", "flash"], "flash"),
        (["--encodings", "sinusoidal"], "sinusoidal"),
        (["--reps", "0"], "--reps"),
        (["--lengths", "0"], "--lengths"),
    ):
        with pytest.raises(SystemExit):
            device.parse(argv)
        assert named in capsys.readouterr().err


def _measured(seconds):
    return {"status": "measured", "seconds": seconds, "memory_bytes": 2**20, "finite": True}


def test_a_gpu_table_divides_by_cudnn_nope_and_marks_where_xla_stands_in(device):
    facts = {
        "backend": "gpu",
        "device_kind": "NVIDIA H200",
        "command": "python benchmarks/device.py",
        "date": "today",
        "jax": jax.__version__,
        "jaxlib": "?",
        "device_count": 1,
        "matmul_precision": "None",
        "settings": dict(tokens=16384, width=2048, reps=5, bidirectional=False, encodings=["nope", "alibi"]),
    }
    failed = {"status": "error", "reason": "NotImplementedError: not here"}
    rows = []
    for length, cudnn in ((1024, _measured(0.002)), (2048, failed)):
        for encoding, path, result in (
            ("nope", "cudnn", cudnn),
            ("nope", "xla", _measured(0.004)),
            ("alibi", "pallas", _measured(0.003)),
        ):
            row = dict(encoding=encoding, path=path, length=length, head_dim=128, batch=16384 // length, heads=16)
            rows.append({**row, "fwd": result, "fwd+bwd": result})
    table = device.table(rows, facts)
    assert "Attention on NVIDIA H200 (gpu)" in table and "bfloat16" in table and "TF32" in table
    cells = _rows(table)
    assert cells[("alibi", "pallas", 1024)][5] == "1.50×"  # over cuDNN's 2 ms
    assert cells[("alibi", "pallas", 2048)][5] == "0.75× †"  # cuDNN failed there: over XLA's 4 ms, marked
    assert cells[("nope", "cudnn", 2048)][4] == "error" and "NotImplementedError" in cells[("nope", "cudnn", 2048)][-1]


def test_the_planner_scales_a_measured_run_by_the_work_and_skips_what_would_pass_the_deadline(device):
    planner = device.Planner(deadline=time.monotonic() + 100.0, reps=5)
    planner.record(("pallas", "nope", 128, "fwd"), work=1e6, compile_seconds=2.0, run_seconds=1.0)
    assert planner.run_seconds(("pallas", "nope", 128, "fwd"), 4e6) == pytest.approx(4.0)
    assert planner.run_seconds(("pallas", "alibi", 128, "fwd"), 2e6) == pytest.approx(2.0)  # NoPE's, scaled
    assert planner.run_seconds(("xla", "alibi", 128, "fwd"), 2e6) is None
    assert planner.plan(("pallas", "alibi", 128, "fwd"), 1e7) == (5, None)  # 2 s + 6 runs of 10 s
    assert planner.plan(("pallas", "alibi", 128, "fwd"), 4e7)[0] == 1  # 6 runs of 40 s would not fit; 2 do
    reps, why = planner.plan(("pallas", "alibi", 128, "fwd"), 1e8)
    assert reps == 0 and why.startswith("budget: predicted")
