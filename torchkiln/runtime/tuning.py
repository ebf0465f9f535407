"""Choosing the layout by measuring it: `torchkiln run --autotune` and `tk.runtime.autotune`.

IPEX's launcher had fixed layouts; which one is fastest depends on the model, the batch and the machine
(resnet50 bf16 bs16 on the H200 host's 16 cores: 8 instances x 2 cores gave 2.28x one 16-core
instance, 2 x 8 only 1.34x; benchmarks/RESULTS.md "Layout autotune"). So the tuner runs the user's own
short benchmark under a few layouts (1 instance on a whole node, then instances of 1/2, 1/4, ... of a
node, as many as fit) and keeps the best as JSON for `torchkiln run --layout FILE`:

- each layout's instances start once and stay up for every round (runtime/timed.py): they warm up (and
  run tk.optimize) once, then each round times one window per layout, one layout at a time, after every
  instance of every layout is warm; the layout's throughput is the sum of its instances' items per
  second, its latency the median of their median call. Before, each trial restarted its processes and
  paid the warm-up again: ~70 s a trial for resnet50 on the H200 host's 16 cores;
- a script that never calls `measure` is timed as whole processes (start-up included), and says so;
- with several rounds the layouts are interleaved round by round (this machine's speed drifts by up to
  30% over seconds, so back-to-back blocks would compare drift) and the median round counts;
- the file records the machine it was tuned on; on another machine (other CPUs, model or NUMA nodes)
  `--layout` warns and re-plans with the default rule instead of applying a foreign layout.

The launcher side imports only the standard library; `autotune(model, sample)` imports torch to save
the model for its worker processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import timed as _measure
from .bind import format_cpus
from .layout import Layout, plan_layout

__all__ = ["Trial", "Tuned", "autotune", "candidate_layouts", "load_layout", "machine_fingerprint", "tune"]

FORMAT = "torchkiln-layout/1"
GOALS = ("throughput", "latency")


@dataclass(frozen=True)
class Trial:
    instances: int
    cores_per_instance: int
    cpus: str  # the CPUs the layout used, kernel list syntax
    items_per_s: float | None  # summed over the instances; median over rounds
    latency_ms: float | None  # median over instances of their median call; median over rounds
    rounds: tuple[float, ...] = ()  # items_per_s of each round
    source: str = "measure"  # "measure" (the script called tk.runtime.measure) | "wall" (whole processes)
    error: str | None = None


@dataclass(frozen=True)
class Tuned:
    """What a tuning run measured and chose. `best` holds plan_layout's arguments, not CPU numbers, so
    the same machine re-derives the same slices."""

    machine: dict
    goal: str
    best: dict  # {"instances", "cores_per_instance", "use_logical_cores", "node_id"}
    trials: tuple[Trial, ...]
    command: tuple[str, ...]
    seconds: float
    rounds: int
    date: str
    format: str = FORMAT

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path, overwrite: bool = False) -> None:
        path = Path(path)
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True (--force) to replace it")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)  # a crash mid-write never leaves half a file under the real name

    def table(self) -> str:
        rows = [f"{'layout':<22} {'items/s':>10} {'latency ms':>11}  cpus"]
        for t in self.trials:
            name = f"{t.instances} x {t.cores_per_instance} cores"
            if t.error:
                rows.append(f"{name:<22} {'failed':>10} {'':>11}  {t.cpus}: {t.error}")
                continue
            mark = "  <- best" if (t.instances, t.cores_per_instance) == (
                self.best["instances"], self.best["cores_per_instance"]) else ""
            rows.append(f"{name:<22} {t.items_per_s:>10.2f} {t.latency_ms:>11.2f}  {t.cpus}{mark}")
        if any(t.source == "wall" for t in self.trials):
            rows.append("timed as whole processes, start-up included (the script does not call "
                        "tk.runtime.measure): items/s counts runs of the script")
        return "\n".join(rows)


def machine_fingerprint(topology) -> dict:
    """What must match for a tuned layout to apply: the CPU model, the usable CPUs and their nodes."""
    from ..hardware.cpu import _read, parse_cpuinfo

    info = parse_cpuinfo(_read("/proc/cpuinfo") or "")
    per_node: dict[str, int] = {}
    for c in topology.cpus:
        per_node[str(c.node)] = per_node.get(str(c.node), 0) + 1
    return {"cpu_model": info.get("model"), "cpus": format_cpus(c.cpu for c in topology.cpus),
            "physical_cores": len(topology.physical()), "cpus_per_node": per_node}


def candidate_layouts(topology, instances: Sequence[int] | None = None, node_id: int | None = None,
                      use_logical_cores: bool = False) -> list[Layout]:
    """By default: 1 instance on a whole node (the latency layout), then slices of 1/2, 1/4, ... of a node
    down to 1 core, each with as many instances as fit in every node. With `instances`: those counts,
    each the largest equal slice that fits. A layout reached twice is measured once."""
    def plan(**kw):
        return plan_layout(topology, node_id=node_id, use_logical_cores=use_logical_cores, **kw)

    if instances is None:
        largest = len(plan(instances=1).instances[0].cpus)
        sizes = sorted({max(1, largest >> p) for p in range(largest.bit_length())}, reverse=True)
        layouts = [plan(instances=1)] + [plan(cores_per_instance=s) for s in sizes]
    else:
        layouts = [plan(instances=k) for k in sorted(set(instances))]
    seen, out = set(), []
    for layout in layouts:
        key = tuple(i.cpus for i in layout.instances)
        if key not in seen:
            seen.add(key)
            out.append(layout)
    return out


class _Running:
    """One layout's instances, started once and kept up for every round (runtime/timed.py's protocol:
    ready_I when warm, then one timed window per go_R, until stop)."""

    def __init__(self, plan, folder: Path, seconds: float):
        folder.mkdir()
        extra = {_measure.DIR_ENV: str(folder), _measure.SECONDS_ENV: str(seconds)}
        self.folder = folder
        self.procs = [dataclasses.replace(p, env={**p.env, **extra}) for p in plan.processes]
        self.codes: list[int] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from .supervise import run_processes

        try:
            self.codes = run_processes(self.procs, log_dir=str(self.folder / "logs"), out=io.StringIO())
        except Exception as e:  # could not start: reported as this layout's failure
            self.codes, self.crash = [1] * len(self.procs), f"{type(e).__name__}: {e}"

    def start(self) -> _Running:
        self.thread.start()
        return self

    def started(self) -> bool:
        return self.thread.ident is not None

    def exited(self) -> bool:
        return self.started() and not self.thread.is_alive()

    def ready(self) -> bool:
        return all((self.folder / f"ready_{p.index}").exists() for p in self.procs)

    def reports(self, r: int) -> list[dict] | None:
        paths = [self.folder / f"report_{r}_{p.index}.json" for p in self.procs]
        return [json.loads(f.read_text()) for f in paths] if all(f.exists() for f in paths) else None

    def signal(self, name: str) -> None:
        (self.folder / name).touch()

    def error(self) -> str | None:
        """Why this layout failed: the first instance that exited non-zero, with its exception's line."""
        if getattr(self, "crash", None):
            return self.crash
        for p, code in zip(self.procs, self.codes or [], strict=False):
            if code != 0:
                log = self.folder / "logs" / f"instance_{p.index}.log"
                lines = [ln for ln in (log.read_text(errors="replace").splitlines() if log.exists() else [])
                         if ln.strip()]
                # The exception's own line when there is one; warnings often come after it or instead.
                last = next((ln for ln in reversed(lines) if "Error" in ln or "Exception" in ln),
                            lines[-1] if lines else "no output")
                return f"instance {p.index} exited {code}: {last.strip()[:200]}"
        return None


def _until(condition) -> None:
    while not condition():
        time.sleep(0.05)


def _measure_all(running: list[_Running], rounds: int, errors: list, results: list, tick) -> None:
    """Every layout already started and warm (or failed): one window per layout per round, one layout at
    a time, the others idle."""
    for r in range(rounds):
        for i, run in enumerate(running):
            if errors[i] is None:
                run.signal(f"go_{r}")
                _until(lambda run=run, r=r: run.reports(r) is not None or run.exited())
                reports = run.reports(r)
                if reports is None:
                    errors[i] = run.error() or "an instance exited before its window ended"
                else:
                    results[i].append((reports, None))
            if tick:
                tick()


def _wall_run(plan, folder: Path) -> tuple[float, str | None]:
    """A script that never calls measure: one run of the layout, timed whole."""
    run = _Running(plan, folder, 1.0)
    t0 = time.perf_counter()
    run.start().thread.join()
    return time.perf_counter() - t0, run.error()


def tune(script: str, script_args: Sequence[str], topology, host=None, instances: Sequence[int] | None = None,
         node_id: int | None = None, use_logical_cores: bool = False, seconds: float = 3.0, rounds: int = 1,
         goal: str = "throughput", omp_choice: str = "auto", memory_allocator: str = "auto",
         show_progress: bool = True, extra_env: dict | None = None) -> Tuned:
    """Measure `script` under each candidate layout and choose the best for `goal`.

    The first layout starts alone: if its script exits without calling measure, every layout is timed
    as whole runs, one after another. Otherwise all the other layouts start and warm up too, then each
    round times one window per layout, one layout at a time. `host`: launch.detect_host's facts
    (detected here when None)."""
    from ..progress import ticks
    from .launch import build_plan, detect_host

    if goal not in GOALS:
        raise ValueError(f"goal={goal!r}: use 'throughput' (items per second over all instances) or "
                         "'latency' (the median call of one instance)")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r}: a positive integer")
    if not float(seconds) > 0:
        raise ValueError(f"seconds={seconds!r}: a positive number of seconds each layout is timed for")
    layouts = candidate_layouts(topology, instances, node_id, use_logical_cores)
    host = host or detect_host(layouts[0], numa_nodes=len(topology.nodes()))
    plans = [build_plan(lay, script, list(script_args), host, omp_choice=omp_choice,
                        memory_allocator=memory_allocator) for lay in layouts]
    if extra_env:
        plans = [dataclasses.replace(p, processes=tuple(dataclasses.replace(q, env={**q.env, **extra_env})
                                                        for q in p.processes)) for p in plans]
    results: list[list] = [[] for _ in layouts]
    errors: list[str | None] = [None] * len(layouts)
    with tempfile.TemporaryDirectory(prefix="torchkiln-autotune-") as tmp, \
            ticks(show_progress, "autotune layouts", len(layouts) * rounds) as tick:
        running = [_Running(plan, Path(tmp) / f"l{i}", seconds) for i, plan in enumerate(plans)]
        mode, ok = None, False
        try:
            for i, run in enumerate(running):  # the first layout that gets warm decides the mode
                run.start()
                _until(lambda run=run: run.ready() or run.exited())
                if run.ready():
                    mode = "measure"
                    break
                if run.codes and not any(run.codes):
                    mode = "wall"
                    break
                errors[i] = run.error()
            if mode == "measure":
                rest = [run.start() for run in running if not run.started()]
                _until(lambda: all(run.ready() or run.exited() for run in rest))
                for i, run in enumerate(running):
                    if errors[i] is None and not run.ready():
                        errors[i] = run.error() or "exited without calling tk.runtime.measure"
                _measure_all(running, rounds, errors, results, tick)
            elif mode == "wall":
                for r in range(rounds):
                    for i, plan in enumerate(plans):
                        if errors[i] is None:
                            wall, errors[i] = _wall_run(plan, Path(tmp) / f"wall_r{r}_l{i}")
                            results[i].append(([], wall))
                        if tick:
                            tick()
            ok = True
        finally:
            for run in running:
                if run.started():
                    run.signal("stop" if ok else "abort")
            if ok:  # each script finishes what follows its measure() call
                for run in running:
                    if run.started():
                        run.thread.join()
    trials = tuple(_trial(lay, res, err) for lay, res, err in zip(layouts, results, errors, strict=True))
    ok = [t for t in trials if t.error is None]
    if not ok:
        err = RuntimeError("torchkiln autotune: every layout failed:\n" +
                           "\n".join(f"  {t.instances} x {t.cores_per_instance}: {t.error}" for t in trials))
        err.for_the_user = True  # the CLI prints it as it is (it was a traceback)
        raise err
    pick = max if goal == "throughput" else min
    best = pick(ok, key=lambda t: t.items_per_s if goal == "throughput" else t.latency_ms)
    chosen = {"instances": best.instances, "cores_per_instance": best.cores_per_instance,
              "use_logical_cores": use_logical_cores, "node_id": node_id}
    return Tuned(machine=machine_fingerprint(topology), goal=goal, best=chosen, trials=trials,
                 command=(script, *script_args), seconds=float(seconds), rounds=rounds,
                 date=datetime.datetime.now().isoformat(timespec="seconds"))


def _trial(layout: Layout, runs: list, error: str | None) -> Trial:
    n, size = len(layout.instances), len(layout.instances[0].cpus)
    cpus = format_cpus(c for i in layout.instances for c in i.cpus)
    if error is not None:
        return Trial(n, size, cpus, None, None, error=error)
    per_round, latency = [], []
    source = "measure" if all(reports for reports, _ in runs) else "wall"
    for reports, wall in runs:
        if source == "measure":
            per_round.append(sum(r["items_per_s"] for r in reports))
            latency.append(statistics.median(r["latency_ms"] for r in reports))
        else:  # runs of the whole script per second, over all instances
            per_round.append(n / wall)
            latency.append(wall * 1e3)
    return Trial(n, size, cpus, statistics.median(per_round), statistics.median(latency),
                 rounds=tuple(per_round), source=source)


def load_layout(path, topology) -> tuple[dict | None, str | None]:
    """plan_layout's arguments from a tuned file, or (None, why) when it was tuned on another machine."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--layout {path!r}: no such file (make one with torchkiln run --autotune)"
                                ) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"--layout {path!r}: not a layout file ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("best"), dict):
        raise ValueError(f"--layout {path!r}: not a {FORMAT} file written by torchkiln run --autotune")
    here = machine_fingerprint(topology)
    diff = [k for k in here if data.get("machine", {}).get(k) != here[k]]
    if diff:
        theirs = data.get("machine", {})
        what = "; ".join(f"{k}: tuned on {theirs.get(k)!r}, here {here[k]!r}" for k in diff)
        return None, f"{path} was tuned on another machine ({what}); re-planning with the default layout"
    keys = ("instances", "cores_per_instance", "use_logical_cores", "node_id")
    return {k: data["best"].get(k) for k in keys}, None


def autotune(model, sample, *, items: int | None = None, dtype=None, optimize: bool = True,
             instances: Sequence[int] | None = None, seconds: float = 3.0, rounds: int = 1,
             goal: str = "throughput", save=None, overwrite: bool = False, node_id: int | None = None,
             progress: bool = True) -> Tuned:
    """Measure `model(sample)` under each candidate layout, in worker processes as `torchkiln run` would
    start them, and return the choice (saved to `save` when given, for `torchkiln run --layout`).

    Each instance loads the model (its class must be importable: defined in a module, not in __main__)
    and, with `optimize=True`, runs `tk.optimize(model, dtype=dtype, sample_input=sample)` with its own
    thread count before timing. `items` is one call's batch (default: the sample's first dimension)."""
    import torch

    from ..hardware.topology import detect_topology

    if save is not None and Path(save).exists() and not overwrite:
        raise FileExistsError(f"save={str(save)!r} exists; pass overwrite=True to replace it")
    if type(model).__module__ == "__main__":
        raise ValueError(f"model: {type(model).__name__} is defined in __main__, which the worker processes "
                         "cannot import; move the class into a module, or time your own script with "
                         "`torchkiln run --autotune SCRIPT` and tk.runtime.measure")
    if items is None:
        from ..inputs import flatten, normalize

        tensors = flatten(normalize(sample))[:1]
        items = int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1
    topology = detect_topology()
    with tempfile.TemporaryDirectory(prefix="torchkiln-autotune-model-") as tmp:
        payload = Path(tmp) / "payload.pt"
        torch.save({"model": model, "sample": sample}, payload)
        worker = Path(__file__).with_name("_tuning_worker.py")
        args = [str(payload), "--items", str(items), "--dtype", str(dtype).replace("torch.", "")]
        args += [] if optimize else ["--no-optimize"]
        # The worker is run by path: it must find the model's module and torchkiln as this process does.
        path = os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
        tuned = tune(str(worker), args, topology, instances=instances, node_id=node_id, seconds=seconds, rounds=rounds, goal=goal,
                     show_progress=progress, extra_env={"PYTHONPATH": path})
    tuned = dataclasses.replace(tuned, command=(f"tk.runtime.autotune({type(model).__name__}, items={items}, "
                                                f"dtype={dtype}, optimize={optimize})",))
    if save is not None:
        tuned.save(save, overwrite=overwrite)
    return tuned
