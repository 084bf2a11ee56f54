"""`python pipes_gate.py GATE_DIR`: the Pipes stand-in behind a gate the test opens.

Each launch writes `GATE_DIR/started-<pid>` (so a test sees which GPU steps have begun), then waits
for `GATE_DIR/release` (at most DEADLINE_S, then fails) and runs pipes_standin.py unchanged. A test
holds the first GPU step open with it to show that a second run's GPU step waits on the pool.
"""

import os
import runpy
import sys
import time
from pathlib import Path

DEADLINE_S = 300.0
STANDIN = Path(__file__).resolve().with_name("pipes_standin.py")


def main() -> None:
    gate = Path(sys.argv[1])
    (gate / f"started-{os.getpid()}").write_text(str(time.time()))
    deadline = time.monotonic() + DEADLINE_S
    while not (gate / "release").exists():
        if time.monotonic() > deadline:
            sys.exit(f"pipes_gate: {gate}/release not created within {DEADLINE_S:.0f}s")
        time.sleep(0.1)
    sys.argv = [str(STANDIN)]
    runpy.run_path(str(STANDIN), run_name="__main__")


if __name__ == "__main__":
    main()
