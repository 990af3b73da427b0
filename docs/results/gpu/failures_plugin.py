"""A pytest plugin for the GPU runs (device.sh): each failure's traceback is appended to
$OUT/failures.txt as it happens, so a run stopped at its time limit still says why tests failed."""

import os


def pytest_runtest_logreport(report):
    if report.failed:
        with open(os.path.join(os.environ["OUT"], "failures.txt"), "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
