"""benchmarks/regional_compile.py's report: compile CPU time is the process's beyond the eager
process's, and the ratios compare whole-model and regional compile with each wrapper."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import regional_compile  # noqa: E402


def _result(variant, process_cpu_s, losses=(5.0, 4.0, 3.0)):
    return {"variant": variant, "step_s": [1.0, 0.01, 0.01], "steady_step_ms": 10.0, "losses": list(losses),
            "phases_s": {}, "graphs": 1, "process_cpu_s": process_cpu_s, "compiler_cpu_s": 1.0, "kernels": 2}


def test_report_ratios_of_compile_cpu_time():
    results = {
        "eager": _result("eager", 3.0),
        "whole": _result("whole", 33.0),                       # 30 s of compile
        "whole-cpp-wrapper": _result("whole-cpp-wrapper", 27.0),  # 24 s
        "regional": _result("regional", 11.0),                 # 8 s
        "regional-python-wrapper": _result("regional-python-wrapper", 15.0),  # 12 s
        "whole+regions": _result("whole+regions", 23.0, losses=(5.0, 4.00001, 3.0)),  # 20 s
    }
    text = regional_compile.report(results, 12, "gpt2")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 30.0 |" in rows["whole"] and "| 1.00x |" in rows["whole"]
    assert "| 8.0 |" in rows["regional"] and "| 3.75x |" in rows["regional"]
    assert "| 1.50x |" in rows["whole+regions"]
    assert "each with its faster wrapper: 3.00x" in text          # 24 / 8
    assert "both with the Python wrapper (Inductor's default): 2.50x" in text  # 30 / 12
    assert "both with the C++ wrapper: 3.00x" in text              # 24 / 8
    assert "Largest loss difference from whole-model compile: 1.00e-05" in text
