"""Where a process's host memory peaks: run a Python script in this process while a thread samples the resident
set, and record the main thread's stack at each new high (by at least ``--step`` MB). The highs, each with its
spap_lib / transformers / gguf frames, show which call raised the peak and by how much.

    python bench/host_peak.py --out bench/results/host_peak_qwen_gguf.txt -- bench/offload.py \
        --model qwen2.5-coder-0.5b --modes disk --offload disk --method fasp --nsamples 16 --eval-windows 2

(``--offload`` makes bench/offload.py run its one mode in this process instead of a child.)
"""
from __future__ import annotations

import argparse
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path

from spap_lib.files import write_text_atomic
from spap_lib.numerics.memory import process_peak_rss_mb, rss_mb

OURS = ("spap_lib", "transformers", "gguf", "tokenizers", "bench/")


def frames(stack) -> list[str]:
    """The frames of our code and the libraries that allocate, innermost last."""
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(stack)
            if any(part in f.filename for part in OURS)]


class Sampler(threading.Thread):
    def __init__(self, step_mb: float, every_s: float = 0.005):
        super().__init__(daemon=True)
        self.step, self.every, self.highs, self.done = step_mb, every_s, [], False
        self.main, self.t0 = threading.main_thread().ident, time.perf_counter()

    def run(self) -> None:
        high = 0.0
        while not self.done:
            now = rss_mb()
            if now > high + self.step:
                high = now
                self.highs.append((time.perf_counter() - self.t0, now, frames(sys._current_frames()[self.main])))
            time.sleep(self.every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--step", type=float, default=50.0, help="MB above the last high that counts as a new one")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py and its arguments")
    args = ap.parse_args()
    script = [a for a in args.script if a != "--"]
    sampler = Sampler(args.step)
    sampler.start()
    sys.argv = script
    sys.path.insert(0, str(Path(script[0]).resolve().parent))
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as stop:  # the script's sys.exit(main()): record the highs all the same
        if stop.code:
            raise
    finally:
        sampler.done = True
        sampler.join()
    lines = [f"# Host memory highs of: python {' '.join(script)}",
             f"# peak {process_peak_rss_mb() / 1024:.3f} GB; a line per new high (+{args.step:.0f} MB): "
             "seconds, GB, stack", ""]
    for t, mb, stack in sampler.highs:
        lines.append(f"{t:8.1f} s  {mb / 1024:6.3f} GB  " + " > ".join(stack[-6:]))
    write_text_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines[-40:]))


if __name__ == "__main__":
    main()
