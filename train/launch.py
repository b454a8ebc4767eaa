"""``eagle-train``: run ``train/main.py`` through the ``deepspeed`` launcher.

Every argument is passed on: launcher options first (``--num_gpus``, ``--num_nodes``,
``--hostfile``, ...) then ``--`` and the trainer's (``--config``, ``--set``, ``--report-to``).
Without ``--``, all arguments go to the trainer. ``run_single`` runs the trainer as one process
with the rendezvous variables set (one device, no launcher)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher, trainer = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    beside = Path(sys.executable).with_name("deepspeed")
    exe = str(beside) if beside.is_file() else shutil.which("deepspeed")
    if exe is None:
        print("eagle-train: error: the deepspeed launcher is not installed: pip install deepspeed", file=sys.stderr)
        return 2
    script = str(Path(__file__).with_name("main.py"))
    os.execv(exe, [exe, *launcher, script, *trainer])
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_single(config: Path, log: Path, timeout: float, extra: list[str] | None = None) -> tuple[int, list[dict]]:
    """``train/main.py --config config`` as one process on one device (``RANK`` 0 of 1, a free local
    port), at most ``timeout`` seconds (then exit status 124); its stdout and stderr go to ``log``.
    Returns the exit status and the JSON lines it printed (log lines, evaluations)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p])}
    try:
        proc = subprocess.run([sys.executable, str(root / "train" / "main.py"), "--config", str(config),
                               "--report-to", "none", *(extra or [])], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=root)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = 124, exc.stdout or "", exc.stderr or ""
        out, err = (out.decode() if isinstance(out, bytes) else out), (err.decode() if isinstance(err, bytes) else err)
    log.write_text(out + "\n--- stderr ---\n" + err)
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return code, rows


if __name__ == "__main__":
    sys.exit(main())
