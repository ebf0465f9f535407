"""Graph capture with torch.compile, configured by the recipe.

Inductor options are applied with ``torch._inductor.config.patch`` around every
call rather than ``torch.compile(options=...)``: on torch 2.13 ``options=
{"freezing": True}`` does not freeze parameters into constants, and inductor's
oneDNN lowering then fails (``assert w.get_name() in V.graph.constants``).
Compilation is lazy and may recur on any call (a new shape), so the patch
wraps each call (35 us on a 2-core Zen 3; Compiled._patch halves it where torch allows),
and nothing global stays changed, with calls from many threads too (_ProcessPatch, torch < 2.13).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import threading
import time
import types
import weakref

import torch
from torch import nn

from ..inputs import flatten, signature

_ids = itertools.count()

# Compiling for a new input signature can run for many minutes where eager answers in milliseconds:
# MobileViT's automatic-dynamic recompile at a second batch size (torch 2.13 inductor, stock
# torch.compile alike) ran past 15 minutes after a 22-s first compile (the thirty-sixth session's
# sweep, RESULTS.md). So a Compiled's first call at an input signature it has not run runs in a worker
# thread, and the caller waits up to a deadline, then gets CompileTimeout: a candidate failure, so
# the selection or the per-signature detour serves something else. torch's compile goes on in the
# background holding dynamo's process-wide compile lock; until it ends, any other compile would wait
# on that lock, so other first calls fail at once instead.
FIRST_COMPILE_S = 600.0  # a Compiled's very first call (the selection's build)
RECOMPILE_MIN_S = 60.0  # later signatures: at least this, or RECOMPILE_FACTOR times the first compile
RECOMPILE_FACTOR = 3.0
_overdue: dict[threading.Thread, tuple] = {}  # compiles past their deadline, maybe still running: (owner, sig, limit)


class CompileTimeout(RuntimeError):
    """torch.compile did not finish compiling for a call's inputs within the deadline."""


def compiling_late() -> bool:
    """Whether a compile that ran past its deadline is still running: what CompileTimeout's detours wait
    out (optimize.py sends their signatures back to the compiled form once it has ended)."""
    return any(t.is_alive() for t in list(_overdue))


def _past(limit: float) -> str:
    return f"compiling for these inputs ran past {limit:.3g} s (torch.compile goes on in the background)"


class Fresh(nn.Module):
    """Calls ``model`` through a forward with a code object of its own.

    dynamo keys compiled code (and its recompile limit of 8) on code objects, and
    with inlined nn.Modules two instances of one class can share compiled code.
    Each Fresh wrapper gets a distinct cache, so compiled models never share
    graphs (frozen weights are constants in them) nor exhaust each other's limit.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        code = Fresh._forward.__code__.replace(co_name=f"kiln_forward_{next(_ids)}")
        self.forward = types.MethodType(types.FunctionType(code, Fresh._forward.__globals__), self)
        weakref.finalize(self, _forget, code).atexit = False  # nothing to free at interpreter exit

    def _forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def _forget(code: types.CodeType) -> None:
    """Drop dynamo's compiled code for a dead wrapper. dynamo installs each compiled graph
    as a ``__compiled_fn_*`` global of this module and removes it only when the code object's
    cache entry dies, which with these per-wrapper code objects never happened: every optimized
    model left its graphs (frozen weights included) behind, 628 MB for bert-base in bf16 on
    the CPU, 268 MB on the H200 (benchmarks/diag_memory.py). Clearing the cache entry runs
    dynamo's own cleanup, which deletes those globals."""
    try:
        from torch._dynamo.eval_frame import remove_from_cache
    except ImportError:  # pragma: no cover (a torch without it keeps the globals, as before)
        return
    try:
        remove_from_cache(code)
    except Exception:  # noqa: BLE001 (interpreter shutdown: modules half torn down)
        pass


def _guard_filter():
    """Skip dynamo's guards on nn.Module state (guard evaluation showed up in
    torch.profiler traces of small-batch calls). Sound only because torchkiln's runner is private and never mutated
    after optimize(); torch >= 2.8 has the filter, older torch keeps every guard."""
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    return {"guard_filter_fn": skip} if skip is not None else {}


class Compiled(nn.Module):
    def __init__(self, model: nn.Module, options: dict, fullgraph: bool = False, private: bool = False,
                 dynamic: bool | None = None):
        super().__init__()
        self.options = dict(options)
        self._options_key = repr(sorted(self.options.items()))  # _ProcessPatch's: option names are unique
        extra = _guard_filter() if private else {}
        self.compiled = torch.compile(Fresh(model), backend="inductor", fullgraph=fullgraph, dynamic=dynamic,
                                      options=extra or None)
        self._made: list[types.ModuleType] = []  # inductor's output modules compiled by this wrapper's calls
        weakref.finalize(self, _unload, self._made).atexit = False

    def forward(self, *args, **kwargs):
        # Inference calls only: training's backward is compiled apart, in the caller's thread.
        d = self.__dict__  # (read directly: nn.Module's attribute lookup is slower, and this runs every call)
        if d.get("_bounded", True) and not torch.is_grad_enabled():
            sig = signature(args, kwargs)
            if sig not in d.setdefault("_seen", set()):
                return self._first_at(sig, args, kwargs)
        return self._run(args, kwargs)

    def _first_at(self, sig, args, kwargs):
        """The first call at a signature, bounded (FIRST_COMPILE_S, RECOMPILE_*) where that is safe:
        CPU inputs, on a torch whose inductor config patches are per thread (2.13; on older torch a
        patch left held by an overdue compile would block every other call's). On CUDA the call stays
        in the caller's thread: its current stream and CUDA-graph trees are per thread. Where it is not
        safe, this Compiled stops keeping signatures."""
        if not patches_per_thread() or any(t.device.type != "cpu" for t in flatten((args, kwargs))):
            self.__dict__["_bounded"] = False
            return self._run(args, kwargs)
        for t in [t for t in _overdue if not t.is_alive()]:
            _overdue.pop(t, None)
        if _overdue:
            owner, at, limit = next(iter(_overdue.values()))
            raise CompileTimeout(_past(limit) if owner is self and at == sig else
                                 f"another compile ran past its deadline ({limit:.3g} s) and is still running; "
                                 "compiling now would wait for it")
        first = self.__dict__.get("_first_s")
        limit = FIRST_COMPILE_S if first is None else max(RECOMPILE_MIN_S, RECOMPILE_FACTOR * first)
        box: dict = {}
        inference = torch.is_inference_mode_enabled()
        amp = torch.is_autocast_enabled("cpu")
        amp_dtype = torch.get_autocast_dtype("cpu")

        def work():  # the caller's thread-local modes (the context variables come with copy_context)
            try:
                # (inference_mode(False) turns grad mode on: only entered when on, before no_grad)
                modes = torch.inference_mode() if inference else contextlib.nullcontext()
                with modes, torch.no_grad(), torch.autocast("cpu", dtype=amp_dtype, enabled=amp):
                    box["out"] = self._run(args, kwargs)
            except BaseException as e:  # noqa: BLE001 (raised again in the caller's thread)
                box["error"] = e

        t0 = time.perf_counter()
        worker = threading.Thread(target=contextvars.copy_context().run, args=(work,), daemon=True,
                                  name="torchkiln-compile")
        worker.start()
        worker.join(limit)
        if worker.is_alive():
            _overdue[worker] = (self, sig, limit)
            raise CompileTimeout(_past(limit))
        if "error" in box:
            raise box["error"]
        if first is None:
            self.__dict__["_first_s"] = time.perf_counter() - t0
        self.__dict__["_seen"].add(sig)
        return box["out"]

    def _run(self, args, kwargs):
        mods = _output_modules()
        before = len(mods)
        tallies = _metric_tallies()
        marks = [len(t) for t in tallies]
        with self._patch():
            out = self.compiled(*args, **kwargs)
        if len(mods) > before:  # compiled in this call (first call, a new shape)
            self._made.extend(mods[before:])
        if not tallies:  # inductor (and its metrics) first loaded in this call: all they hold is from it
            tallies = _metric_tallies()
            marks = [0] * len(tallies)
        for t, n in zip(tallies, marks, strict=True):
            if len(t) > n:
                del t[n:]
        return out

    def _patch(self):
        """The options' config patch for one call. Building one took 17 us and entering it 18 (2-core
        Zen 3, torch 2.13), on every call: where patches_per_thread(), one is kept and re-entered;
        elsewhere concurrent calls share one (_ProcessPatch)."""
        import torch._inductor.config as inductor_config

        if not patches_per_thread():
            return _PROCESS_PATCH.hold(self._options_key, self.options)
        patch = self.__dict__.get("_kept_patch")
        if patch is None:
            patch = self.__dict__["_kept_patch"] = inductor_config.patch(self.options)
        return patch


class _ProcessPatch:
    """Inductor options for calls from many threads, where torch's config is process-wide (torch < 2.13).

    A patch per call there raced: a thread leaving its patch restored the values another thread's
    call still ran under (a compile started then lost the options: on the CPU, freezing), and a
    patch entered inside another one restored the patched values on leaving, so they stayed set
    for the process (tests/passes/test_compile.py). Here calls with the same options share one
    applied patch, counted, and the last to leave restores; a call with other options waits until
    none is inside (one model served from many threads never waits), and new calls with the active
    options wait behind it, so it is not starved. A call made inside another in the same thread (a
    compiled model calling another) never waits: its patch stacks on the one it is in, as a single
    thread's patches always did."""

    def __init__(self):
        self._cond = threading.Condition()
        self._key: str | None = None
        self._count = 0
        self._waiting = 0
        self._applied = None
        self._patches: dict[str, object] = {}
        self._depth = threading.local()

    @contextlib.contextmanager
    def hold(self, key: str, options: dict):
        import torch._inductor.config as inductor_config

        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        try:
            if depth:  # nested in this thread's own call
                if key == self._key:
                    yield
                else:
                    with inductor_config.patch(options):
                        yield
                return
            self._enter(key, options)
            try:
                yield
            finally:
                self._leave()
        finally:
            self._depth.n = depth

    def _enter(self, key: str, options: dict) -> None:
        import torch._inductor.config as inductor_config

        with self._cond:
            if self._count and (self._key != key or self._waiting):
                self._waiting += 1
                try:
                    while self._count:
                        self._cond.wait()
                finally:
                    self._waiting -= 1
            if not self._count:
                # One patch kept per options set: inductor_config.patch() defines a class at each call,
                # 15 us of the host time of a CUDA-graph replay (bert-base bs1 on the H200, torch 2.11,
                # cProfile; thirty-sixth session). Reused only entered alone: the count above.
                patch = self._patches.get(key)
                if patch is None:
                    patch = self._patches[key] = inductor_config.patch(options)
                patch.__enter__()
                self._applied, self._key = patch, key
            self._count += 1

    def _leave(self) -> None:
        with self._cond:
            self._count -= 1
            if not self._count:
                self._applied.__exit__(None, None, None)
                self._applied, self._key = None, None
                self._cond.notify_all()


_PROCESS_PATCH = _ProcessPatch()


@functools.cache
def patches_per_thread() -> bool:
    """Does this torch keep a config patch's saved values per thread and entry (a ContextVar: torch
    2.13), so one patch can be re-entered from any thread? torch 2.6 and 2.11 keep them in the patch's
    closure, and config is process-wide there: two threads entering one patch would restore each
    other's values."""
    import torch._inductor.config as inductor_config

    return isinstance(getattr(inductor_config.patch({}), "_prior", None), contextvars.ContextVar)


_modules: list | None = None


def _output_modules() -> list:
    """inductor's list of loaded output modules (``PyCodeCache.modules``; an empty
    stand-in on a torch without it)."""
    global _modules
    if _modules is None:
        from torch._inductor.codecache import PyCodeCache

        _modules = getattr(PyCodeCache, "modules", None)
        if not isinstance(_modules, list):
            _modules = []
    return _modules


_tallies: list | None = None


def _metric_tallies() -> list[list]:
    """inductor's per-compile metric lists that hold the compiled graph's scheduler nodes (and through
    them, with freezing, the frozen weights). torch 2.6 appended to them on every compile and cleared them
    only in torch._dynamo.reset(): every dropped model kept its weights (16 MB of a 16 MB model in
    tests/passes/test_compile.py). torch 2.13 appends only while inductor's metrics log is on. What a call
    of ours added is dropped after it (the log, if on, has printed it by then). The lists are found once:
    torch extends and clears them in place, never rebinds them."""
    global _tallies
    if _tallies is None:
        import sys

        m = sys.modules.get("torch._inductor.metrics")
        if m is None:  # not loaded yet: nothing compiled so far
            return []
        _tallies = [t for t in (getattr(m, "nodes_num_elem", None), getattr(m, "node_runtimes", None))
                    if isinstance(t, list)]
    return _tallies


def _unload(made: list[types.ModuleType]) -> None:
    """Let a dead wrapper's output modules go. Inductor keeps every module that carries
    constants (with freezing: the model's weights) in PyCodeCache.modules and sys.modules
    for the process's life: 300 MB of bert-base's frozen weights per optimized model on
    the CPU. Only the cache's references are dropped: a module another live compiled
    function uses (one compiled by another thread during our call) stays alive through it."""
    import sys

    if not made or _modules is None:
        return
    ids = {id(m) for m in made}
    _modules[:] = [m for m in _modules if id(m) not in ids]
    for m in made:
        if sys.modules.get(m.__name__) is m:
            del sys.modules[m.__name__]
    made.clear()


def compile_model(model: nn.Module, options: dict, fullgraph: bool = False, private: bool = False,
                  dynamic: bool | None = None) -> nn.Module:
    """``private=True``: the caller guarantees ``model`` is never mutated afterwards. ``dynamic``
    is torch.compile's: None lets a second input shape recompile with symbolic sizes."""
    return Compiled(model, options, fullgraph, private, dynamic)
