"""`torchkiln run` end to end on this machine: real processes, real affinity masks."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchkiln import cli
from torchkiln.runtime.torchrun import BIND_SCRIPT

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 allowed CPUs")

# Prints what the instance was given; exits with $EXIT_<instance> (default 0). One os.write per line:
# torchrun's ranks share one pipe, and print() may split a line into several writes.
SHOW = """\
import os, sys
inst = os.environ.get("TORCHKILN_INSTANCE", os.environ.get("LOCAL_RANK"))
cpus, omp = sorted(os.sched_getaffinity(0)), os.environ.get("OMP_NUM_THREADS")
os.write(1, f"cpus {cpus} omp {omp} args {sys.argv[1:]} {'torch' in sys.modules}\\n".encode())
os.write(1, f"second line of {inst}\\n".encode())
sys.exit(int(os.environ.get("EXIT_" + str(inst), "0")))
"""


@pytest.fixture
def show(tmp_path):
    path = tmp_path / "show.py"
    path.write_text(SHOW)
    return str(path)


def parse(out: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"\[(\d+)\] (.*)", line)
        assert m, f"unprefixed line {line!r}"
        lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return lines


@two_cores
def test_two_instances_each_on_its_own_core(show, tmp_path, capsys):
    logs = tmp_path / "logs"
    rc = cli.main(["run", "--instances", "2", "--cores-per-instance", "1", "--log-dir", str(logs),
                   show, "--json", "--", "-x"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = parse(captured.out)
    assert set(lines) == {0, 1}
    cpus = []
    for i in (0, 1):
        first, second = lines[i]
        m = re.fullmatch(r"cpus \[(\d+)\] omp 1 args \['--json', '--', '-x'\] False", first)
        assert m, first
        cpus.append(int(m.group(1)))
        assert second == f"second line of {i}"
        header, *body = (logs / f"instance_{i}.log").read_text().splitlines()
        assert header.startswith("=== torchkiln run, ") and body == [first, f"second line of {i}"]
    assert cpus == ALLOWED[:2]  # each its own slice, in order
    assert "torchkiln run: 2 instances x 1 physical cores" in captured.err  # the plan goes to stderr
    # a second run into the same folder appends (it overwrote the first run's logs), and torchkiln's own
    # numbering wins over one inherited from the environment (every instance read the same number)
    env = {"TORCHKILN_INSTANCE": "0", "TORCHKILN_INSTANCES": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert cli.main(["run", "--instances", "2", "--cores-per-instance", "1", "--log-dir", str(logs), show]) == 0
    capsys.readouterr()
    for i in (0, 1):
        text = (logs / f"instance_{i}.log").read_text()
        assert text.count("=== torchkiln run, ") == 2 and text.count(f"second line of {i}") == 2


@two_cores
def test_instances_start_within_a_second_of_each_other(tmp_path, capsys):
    # The launcher-overhead bound: each instance's first line carries the time it started.
    script = tmp_path / "stamp.py"
    script.write_text("import time\nprint(time.time())\n")
    before = time.time()
    assert cli.main(["run", "--instances", "2", str(script)]) == 0
    stamps = [float(v[0]) for v in parse(capsys.readouterr().out).values()]
    assert len(stamps) == 2 and max(stamps) - min(stamps) < 1.0, stamps
    assert min(stamps) - before < 2.0  # and the first within 2 s of the call (Python start-up included)


@two_cores
def test_worst_exit_code_is_returned(show, capsys, monkeypatch):
    monkeypatch.setenv("EXIT_1", "3")
    assert cli.main(["run", "--instances", "2", show]) == 3
    assert "exit codes [0, 3]; returning 3" in capsys.readouterr().err


def test_dry_run_json_starts_nothing(show, capsys, monkeypatch):
    monkeypatch.setenv("EXIT_0", "5")  # would fail if the script ran
    assert cli.main(["run", "--dry-run", "--json", show, "--lr", "0.1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mode"] == "instances" and plan["layout"]["instances"]
    proc = plan["processes"][0]
    assert proc["command"][-3:] == [show, "--lr", "0.1"] and proc["env"]["OMP_NUM_THREADS"]


def test_dry_run_after_double_dash(show, capsys):
    assert cli.main(["run", "--dry-run", "--", show, "--dry-run"]) == 0
    assert f"{show} --dry-run" in capsys.readouterr().out


# `python -m torchkiln run ...` as runpy does it, with `import torchkiln` timed apart from the launcher's work.
TIMED_MAIN = """\
import runpy, sys, time
t0 = time.perf_counter()
import torchkiln
t1 = time.perf_counter()
torch_on_import = "torch" in sys.modules
sys.argv = ["torchkiln", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("torchkiln", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print(f"TIMES {t1 - t0:.3f} {time.perf_counter() - t1:.3f} {torch_on_import}", file=sys.stderr)
sys.exit(code)
"""


def test_dry_run_is_fast_as_a_command(show, tmp_path):
    timed = tmp_path / "timed_main.py"
    timed.write_text(TIMED_MAIN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(timed), "run", "--dry-run", "--instances", "1", show],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    assert "instance 0: node" in out.stdout and "OMP_NUM_THREADS=" in out.stdout
    import_s, launcher_s, torch_on_import = re.search(r"TIMES (\S+) (\S+) (\S+)", out.stderr).groups()
    assert float(launcher_s) < 0.5, f"the dry run's own work took {launcher_s} s"
    assert torch_on_import == "False", "importing torchkiln loaded torch: the launcher pays ~2 s for it"
    assert elapsed < 1.0, f"dry run took {elapsed:.2f} s ({import_s} s importing torchkiln)"


@pytest.mark.parametrize("argv,words", [
    (["run", "missing.py"], ["missing.py", "does not exist"]),
    (["run", "--dry-run"], ["no script given"]),
    (["run", "FOLDER"], ["is a folder", "give the Python file"]),
    # the options as typed, not plan_layout's keywords (instances=999 read as a Python call)
    (["run", "--instances", "999", "SHOW"], ["--instances 999", "at most"]),
    (["run", "--nproc-per-node", "999", "SHOW"], ["--nproc-per-node 999", "at most"]),
    (["run", "--node-id", "7", "SHOW"], ["--node-id 7", "use one of"]),
    (["run", "--instances", "0", "SHOW"], ["--instances 0", "positive"]),
    (["run", "--nnodes", "2", "SHOW"], ["--nnodes", "--nproc-per-node"]),
    (["run", "--nproc-per-node", "2", "--instances", "3", "SHOW"], ["--instances 3", "drop --instances"]),
])
def test_bad_input_is_one_line_and_exit_2(show, capsys, monkeypatch, tmp_path, argv, words):
    monkeypatch.setenv("EXIT_0", "5")
    assert cli.main([show if a == "SHOW" else str(tmp_path) if a == "FOLDER" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchkiln: error:") and err.count("\n") == 1
    for w in words:
        assert w in err, err
    assert "=" not in err.split(":")[2], err  # no keyword=value in the option's place


def test_torchrun_dry_run(show, capsys):
    assert cli.main(["run", "--dry-run", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1",
                     "--rdzv-endpoint", "head:29500", show, "--lr", "1"]) == 0
    out = capsys.readouterr().out
    assert "-m torch.distributed.run --nproc-per-node=1 --nnodes=2 --node-rank=1" in out
    assert "--rdzv-endpoint=head:29500" in out
    assert f"{BIND_SCRIPT} --slices=" in out and f"-- {show} --lr 1" in out and "rank 0: node" in out


@two_cores
def test_bind_script_binds_its_local_rank(show):
    # As torchrun would start rank 1: bind.py by path, LOCAL_RANK in the environment.
    env = {**os.environ, "LOCAL_RANK": "1"}
    env.pop("OMP_NUM_THREADS", None)
    slices = f"{ALLOWED[0]}@0/{ALLOWED[1]}@0"
    cmd = [sys.executable, BIND_SCRIPT, f"--slices={slices}", "--omp=gnu", "--", show, "a", "--b"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    # Its own CPU, its thread count, the script's arguments, and no torch imported before the script ran.
    assert out.stdout.splitlines()[0] == f"cpus [{ALLOWED[1]}] omp 1 args ['a', '--b'] False"
    bad = subprocess.run([sys.executable, BIND_SCRIPT, f"--slices={slices}", "--", show],
                         capture_output=True, text=True, env={**env, "LOCAL_RANK": "2"}, timeout=30)
    assert bad.returncode != 0 and "LOCAL_RANK=2 but only 2 CPU slices" in bad.stderr


@two_cores
def test_torchrun_ranks_get_their_own_cores(show):
    out = subprocess.run([sys.executable, "-m", "torchkiln", "run", "--nproc-per-node", "2", show, "--", "-v"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    got = sorted(re.findall(r"cpus \[(\d+)\] omp 1 args \['--', '-v'\] False", out.stdout))
    assert got == [str(c) for c in ALLOWED[:2]], out.stdout


def doc_dry_runs():
    text = (ROOT / "docs" / "runtime.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            argv = argv[2:] if argv[:2] == ["python", "-m"] else argv
            if argv[:3] == ["torchkiln", "run", "--dry-run"]:
                yield pytest.param(argv[1:], id=" ".join(argv[1:]))


@two_cores
@pytest.mark.parametrize("argv", list(doc_dry_runs()))
def test_doc_examples_run(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name in ("infer.py", "train.py"):
        (tmp_path / name).write_text("print('hi')\n")
    rc = cli.main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    if "--json" in argv:
        assert json.loads(out.out)["processes"]
    else:
        assert "$ " in out.out


def test_signals_are_forwarded(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import signal, sys, time\n"
                      "def stop(*_):\n"
                      "    print('got SIGTERM', flush=True)\n"
                      "    sys.exit(7)\n"
                      "signal.signal(signal.SIGTERM, stop)\n"
                      "print('ready', flush=True)\n"
                      "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "torchkiln", "run", "--instances", "1", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline() == "[0] ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 7
        assert proc.stdout.read() == "[0] got SIGTERM\n"
    finally:
        proc.kill()
