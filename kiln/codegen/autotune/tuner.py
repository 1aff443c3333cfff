"""Pick a config for every generated kernel: isolated, cached autotuning that survives crashes.

Why (DESIGN.md failure 5): Triton's autotuner compiles candidates in-process and skips
only OutOfResources, so one config that aborts in Triton's C++ (num_warps 8/16 once
did) or hangs takes the whole compile with it. Here:

1. The mode (ctx.options["tune"]: none | fast | full, default fast) picks the candidate
   configs (candidates.py); configs the resource model says cannot fit the target
   (kiln.codegen.build.resources.precheck), and configs the quarantine says crashed,
   hung or did not fit before, are never compiled.
2. The rest compile in worker processes with a timeout (worker_pool.py); the
   compile function is an import path (ctx.options["tune_compiler"], default
   kiln.codegen.build.compiler:compile_binary), so tests can plant crashes. The
   parent never runs Triton's compiler: it gets back each Binary with real resources,
   and a binary over the target's limits (resources.over_limits) is dropped. Every
   failure is recorded in the quarantine (quarantine.py).
3. With a GPU of the target's kind, the survivors and the extern torch form are timed
   on the example's sizes, dynamic dims raised toward a typical prompt's 512
   (timing.py), and the fastest whose outputs match the torch form's wins (verify.py).
   A decode batch (a dim bounded <= 64) is timed at both its ends; when no candidate
   is near the fastest at both, each end keeps its own winner, run by a SizeSwitch
   (both_ends.py).
   Timing and checking run in the run worker, a process with its own CUDA context
   (isolated_runs.py, run_worker.py): a candidate that faults there (an illegal
   address poisons the context it runs in) or hangs is quarantined as runtime_fault
   and the others go on; the compiling process runs only the winner.
   KILN_TUNE_TIMING=inprocess (or the "tune_timing" option) times in this process
   instead, for debugging. Without a GPU, the
   default wins if it compiled and fits, else the first that does in the spec's order
   (compiling stops as soon as that is known).
4. If nothing compiled and fits, the region runs as its extern form (torch ops), with a
   warning and a region note listing each config and why it failed.
5. The winner and its binary are cached (cache.py): a second compile of the
   same model starts no worker and times nothing.

The `interpret` target runs the spec's default config in Triton's interpreter (no
compile, nothing to tune). KILN_TUNE sets the default mode. Other options:
"tune_timeout" (seconds per compile, default 120), "tune_workers" (pool size),
"tune_run_timeout" (seconds per timing in the run worker, default 60) and
"tune_runner" (the run worker's import path, "module:function"; tests plant faults).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings

from kiln.codegen.autotune import host_cost, power_cap
from kiln.codegen.autotune import quarantine as q
from kiln.codegen.autotune.background_build import BackgroundBuild, job_key
from kiln.codegen.autotune.both_ends import (
    SWITCH_GAIN,
    low_sizes,
    one_serves_both,
    switch_point,
    worst_ratio,
)
from kiln.codegen.autotune.cache import Choice, ChoiceCache, choice_key
from kiln.codegen.autotune.candidates import MODES, candidates
from kiln.codegen.autotune.compile_worker import resolve
from kiln.codegen.autotune.host_cost import host_exposed, with_host_cost
from kiln.codegen.autotune.isolated_runs import (
    DEFAULT_RUN_TIMEOUT,
    DEFAULT_RUNNER,
    IsolatedRuns,
    NoRunWorker,
    Ran,
)
from kiln.codegen.autotune.power_cap import sustained_times
from kiln.codegen.autotune.screen import SCREEN, screened_times
from kiln.codegen.autotune.timing import (
    FINALIST_RATIO,
    bench,
    bottom_env,
    buffer_specs,
    example_buffers,
    gpu_for,
    inplace_inputs,
    low_env,
    sizes_bucket,
    timing_env,
    top_env,
)
from kiln.codegen.autotune.verify import mismatch, outputs
from kiln.codegen.autotune.worker_pool import (
    NO_WORKER,
    OK,
    Job,
    Outcome,
    get_pool,
    get_run_pool,
    shutdown,
    workers_started,
)
from kiln.codegen.build.resources import over_limits, precheck
from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.size_switch import SizeSwitch
from kiln.codegen.torch_kernel import TorchKernel
from kiln.errors import KilnError
from kiln.ir.plan import DispatchPlan, Region
from kiln.progress import phase, progress
from kiln.settings import tune_mode, tune_overlap, tune_timing
from kiln.target import Target

log = logging.getLogger("kiln.codegen")

DEFAULT_COMPILER = "kiln.codegen.build.compiler:compile_binary"
DEFAULT_TIMEOUT = 120.0


class TuningWarning(UserWarning):
    """A kernel fell back to its extern form because no Triton config compiled and fit."""


def choose(region: Region, spec: KernelSpec, target: Target, ctx,
           plan: DispatchPlan | None = None, tuner: Tuner | None = None):
    """The kernel that runs `region`: `spec` at its tuned config, or the extern form.
    `tuner`: one that precompiled the candidates (precompile), else a new one."""
    if target.backend == "interpret":
        return TritonKernel(region, spec, spec.default, interpret=True)
    if tuner is None:
        tuner = Tuner.from_options(target, ctx.options if ctx is not None else {})
    return tuner.choose(region, spec, plan)


def will_time(target: Target, ctx) -> bool:
    """Whether tuning for `target` in this compile times candidates on a GPU here."""
    options = ctx.options if ctx is not None else {}
    mode = options.get("tune") or tune_mode() or "fast"
    return (target.backend != "interpret" and mode != "none" and gpu_for(target)
            and options.get("example_env") is not None)


def start_workers(target: Target, options: dict) -> None:
    """Start the compile workers, and the run worker when candidates will be timed here,
    before the compile needs them: a worker is a fresh interpreter importing torch and
    Triton (10-14 s each when 15 start at once on an H200 machine), which otherwise
    delays the first kernel build (~11 s of an 8B LLM's cold compile). Called before
    export, that start-up overlaps export and the passes instead."""
    if not target.is_gpu or options.get("tune_compiler") not in (None, DEFAULT_COMPILER):
        return
    mode = options.get("tune") or tune_mode() or "fast"
    pool = get_pool(options.get("tune_workers"))
    pool.prestart(pool.size)
    timing = options.get("tune_timing") or tune_timing()
    if mode != "none" and timing == "worker" and gpu_for(target):
        get_run_pool().prestart()


@contextlib.contextmanager
def workers_released_on_failure():
    """Around a compile: if it fails, the workers it started are stopped. Started before
    export (start_workers), they would otherwise sit idle until the process ends, each
    an interpreter with torch imported (~15 of them on a 16-core machine)."""
    before = workers_started()
    try:
        yield
    except BaseException:
        if workers_started() > before:
            shutdown()
        raise


def precompile(work: list[tuple[Region, KernelSpec]], target: Target, ctx,
               plan: DispatchPlan | None) -> Tuner | None:
    """A Tuner that has compiled, in one run of the worker pool, the candidates that
    choosing a kernel for each (region, spec) will need (pass it to choose)."""
    if target.backend == "interpret":
        return None
    tuner = Tuner.from_options(target, ctx.options if ctx is not None else {})
    tuner.precompile(work, plan)
    return tuner


class Tuner:
    def __init__(self, target: Target, mode: str = "fast", compile_fn: str = DEFAULT_COMPILER,
                 timeout: float = DEFAULT_TIMEOUT, workers: int | None = None,
                 example_env: dict[str, int] | None = None, estimator=None,
                 timing: str = "worker", runner: str = DEFAULT_RUNNER,
                 run_timeout: float = DEFAULT_RUN_TIMEOUT, overlap: bool | None = None):
        if mode not in MODES:
            raise KilnError(f"unknown tune mode {mode!r}", hint="choose one of: "
                            + ", ".join(MODES))
        _check_compiler(compile_fn)
        _check_compiler(runner, "tune runner", "fn(task)")
        for name, seconds in (("tune timeout", timeout), ("tune run timeout", run_timeout)):
            if not (isinstance(seconds, int | float) and seconds > 0):
                raise KilnError(f"{name} must be a positive number of seconds, "
                                f"got {seconds!r}")
        if timing not in ("worker", "inprocess"):
            raise KilnError(f"unknown tune timing {timing!r}",
                            hint="choose 'worker' (the default) or 'inprocess'")
        self.target = target
        self.mode = mode
        self.compile_fn = compile_fn
        self.timeout = float(timeout)
        self.workers = workers
        self.example_env = example_env
        self.estimator = estimator  # None: the resource model's own estimate
        self.timing = timing
        self.runner = runner
        self.run_timeout = float(run_timeout)
        self.quarantine = q.Quarantine()
        self.cache = ChoiceCache()
        # (source hash, config) -> Outcome, compiled ahead by precompile
        self._built: dict[tuple[str, Config], Outcome] = {}
        # timed candidates compiled in a thread while the first are timed (KILN_TUNE_OVERLAP)
        self.overlap = tune_overlap() if overlap is None else overlap
        self._background: BackgroundBuild | None = None
        # region name -> its chosen kernel's median ms, when timed (select_kernels weighs
        # grouped sibling GEMVs against the siblings apart with it)
        self.times: dict[str, float] = {}

    @classmethod
    def from_options(cls, target: Target, options: dict) -> Tuner:
        return cls(target, options.get("tune") or tune_mode() or "fast",
                   options.get("tune_compiler") or DEFAULT_COMPILER,
                   options.get("tune_timeout") or DEFAULT_TIMEOUT,
                   options.get("tune_workers"), options.get("example_env"),
                   timing=options.get("tune_timing") or tune_timing(),
                   runner=options.get("tune_runner") or DEFAULT_RUNNER,
                   run_timeout=options.get("tune_run_timeout") or DEFAULT_RUN_TIMEOUT,
                   overlap=options.get("tune_overlap"))

    def choose(self, region: Region, spec: KernelSpec, plan: DispatchPlan | None = None):
        configs = candidates(spec, self.mode)
        sizes = self._timing_sizes(region, plan)
        key = choice_key(spec, configs, self.target, self.mode, sizes or "untimed",
                         self.compile_fn)
        with phase("cache"):
            choice = self.cache.get(key)
        cached = choice is not None
        if choice is None:
            if sizes is not None and self.timing == "worker":
                get_run_pool().prestart()  # it imports torch while the compiles run
            with phase("build"):
                outcomes = self._compile(region, spec, configs, stop_early=sizes is None)
            choice = self._decide(region, spec, configs, outcomes, plan, sizes is not None)
            # A fallback caused by errors that may not recur (see quarantine.py) is redone,
            # as is a choice that should have been timed but could not be.
            if choice.final and (choice.kind != "extern" or choice.ms is not None
                                 or _all_permanent(outcomes)):
                with phase("cache"):
                    self.cache.put(key, choice, spec.name)
        if choice.ms is not None:
            self.times[region.name] = choice.ms
        head = "extern" if choice.kind == "extern" else "tuned"
        region.notes.append(f"{head}{' (cached)' if cached else ''}: {choice.note}")
        if choice.kind == "extern" and choice.ms is None:  # nothing compiled and fit
            warnings.warn(f"kiln: region {region.name} runs as torch ops: {choice.note}",
                          TuningWarning, stacklevel=2)
        return self._kernel(region, spec, choice)

    def _kernel(self, region: Region, spec: KernelSpec, choice: Choice):
        if choice.kind == "switch":
            return SizeSwitch(region, self._kernel(region, spec, choice.low),
                              self._kernel(region, spec, choice.high), choice.low_sizes)
        if choice.kind == "triton":
            return TritonKernel(region, spec, choice.config, choice.binary)
        return TorchKernel(region, self.target.torch_device)

    def precompile(self, work: list[tuple[Region, KernelSpec]],
                   plan: DispatchPlan | None) -> None:
        """Compile every candidate `choose` will need for `work` in one pool run: a model's
        ~30 distinct kernels' configs keep every worker busy, where one kernel's few
        configs at a time left most idle. Untimed (no GPU of the target here), only
        each kernel's first candidate: the first that fits wins, and it nearly always
        does (`choose` compiles the next ones if not)."""
        jobs: list[Job] = []
        keys: set[str] = set()
        wanted: set[tuple[str, Config]] = set()
        timed = False
        for region, spec in work:
            configs = candidates(spec, self.mode)
            sizes = self._timing_sizes(region, plan)
            key = choice_key(spec, configs, self.target, self.mode, sizes or "untimed",
                             self.compile_fn)
            if key in keys:
                continue
            keys.add(key)
            with phase("cache"):
                if self.cache.get(key) is not None:
                    continue
            todo = [c for c in configs if self._needs_compile(spec, c)]
            timed |= sizes is not None
            for c in todo if sizes is not None else todo[:1]:
                if (spec.source_hash, c) not in wanted:
                    wanted.add((spec.source_hash, c))
                    jobs.append(Job(spec, c, self.target, self.compile_fn))
        if not jobs:
            return
        self.finish()  # one run of the pool at a time
        if timed and self.timing == "worker":
            get_run_pool().prestart()  # it imports torch while the compiles run
        if timed and self.overlap:  # each kernel timed once its own candidates are built
            self._background = BackgroundBuild(
                jobs, lambda: self._build_run(jobs, "build (background)"), self._record)
            return
        for i, out in self._build_run(jobs, "build"):
            self._record(jobs[i], out)

    def _build_run(self, jobs: list[Job], name: str):
        """The pool run compiling `jobs`: (index, Outcome) as each finishes."""
        with phase(name), progress(total=len(jobs), desc="compile kernels",
                                   unit="config") as bar:
            for i, out in get_pool(self.workers).run(jobs, self.timeout, lambda: True):
                yield i, out
                bar.update(1)

    def _record(self, job: Job, out: Outcome) -> None:
        self._built[job_key(job)] = self._checked(job.spec, job.config, out)

    def finish(self) -> None:
        """Wait for precompile's background build, if one runs (the pool is free after);
        raise what it raised."""
        if self._background is not None:
            background, self._background = self._background, None
            background.join()

    def _needs_compile(self, spec: KernelSpec, config: Config) -> bool:
        """Neither quarantined nor ruled out by the resource pre-check."""
        if self.quarantine.blocked(q.FailureKey.of(spec, config, self.target)):
            return False
        return not precheck(spec, config, self.target, self.estimator)

    def _timing_sizes(self, region: Region, plan: DispatchPlan | None) -> str | None:
        """The sizes bucket to time at, or None when this tuning is untimed."""
        # a model with static sizes only binds no symbols: its empty env is an example too
        if self.mode == "none" or plan is None or self.example_env is None:
            return None
        if not gpu_for(self.target):
            return None
        try:
            env = timing_env(plan, self.example_env)
            low = low_env(region, plan, env)
            bucket = sizes_bucket(region, plan, env)
            if low is not None:
                # both ends timed; the rule deciding one kernel or a switch is in the key
                return f"{bucket}|{sizes_bucket(region, plan, low)}|switch>{SWITCH_GAIN}"
            if host_exposed(region, plan):  # scored with host cost: another key
                bucket += f"|host {host_cost.EXTERN_CALL_MS}/{host_cost.LAUNCH_MS}"
            top = top_env(region, plan, env)
            if top is None:
                return bucket
            # finalists timed at a long prompt too (_confirmed_at_top)
            bottom = bottom_env(region, plan, env)
            low = f"|bottom {sizes_bucket(region, plan, bottom)}" if bottom else ""
            return (f"{bucket}|top {sizes_bucket(region, plan, top)} "
                    f"{power_cap.key()}{low}|"
                    f"finalists<{FINALIST_RATIO}|switch>{SWITCH_GAIN}")
        except KeyError:
            return None

    def _compile(self, region, spec, configs, stop_early: bool) -> dict[Config, Outcome]:
        """Every candidate's Outcome: from the quarantine, the pre-check, or a worker."""
        outcomes: dict[Config, Outcome] = {}
        todo = []
        for c in configs:
            if self._background is not None:  # built in the background: wait for it
                self._background.wait((spec.source_hash, c))
            built = self._built.get((spec.source_hash, c))
            if built is not None:  # compiled ahead (precompile)
                outcomes[c] = built
                continue
            key = q.FailureKey.of(spec, c, self.target)
            known = self.quarantine.blocked(key)
            why = None if known else precheck(spec, c, self.target, self.estimator)
            if known:
                outcomes[c] = Outcome(known.kind, reason=f"quarantined: {known.reason}")
            elif why:
                outcomes[c] = Outcome(q.OVER_LIMIT, reason=why)
            else:
                todo.append(c)
        def want_more() -> bool:
            return not (stop_early and _first_fit(configs, outcomes) is not None)

        if not todo or not want_more():  # nothing to compile, or the winner is known
            return outcomes

        self.finish()  # the background build's pool run ends before this one starts
        jobs = [Job(spec, c, self.target, self.compile_fn) for c in todo]
        with progress(total=len(jobs), desc=f"tune {region.name}", unit="config") as bar:
            for i, out in get_pool(self.workers).run(jobs, self.timeout, want_more):
                outcomes[todo[i]] = self._checked(spec, todo[i], out)
                ok = sum(o.status == OK for o in outcomes.values())
                bar.set_postfix_str(f"ok={ok} failed={len(outcomes) - ok}", refresh=False)
                bar.update(1)
        return outcomes

    def _checked(self, spec: KernelSpec, config: Config, out: Outcome) -> Outcome:
        """`out` with the target's limits applied, recorded in the quarantine."""
        key = q.FailureKey.of(spec, config, self.target)
        if out.status == OK:
            why = over_limits(out.binary.resources, self.target)
            if why is None:
                if self.quarantine.get(key):  # an earlier error did not recur
                    self.quarantine.forget(key)
                return out
            out = Outcome(q.OVER_LIMIT, reason=why, seconds=out.seconds)
        if out.status != NO_WORKER:
            self.quarantine.record(key, out.status, out.reason, spec.name, self.compile_fn)
            log.info("%s [%s]: %s: %s", spec.name, config, out.status, out.reason)
        return out

    def _decide(self, region, spec, configs, outcomes, plan, timed: bool) -> Choice:
        built = [c for c in configs if c in outcomes and outcomes[c].status == OK]
        failed = "; ".join(f"[{c}] {o.status}: {o.reason}" for c, o in outcomes.items()
                           if o.status != OK)
        tail = f"; failed: {failed}" if failed else ""
        if timed and built:
            with phase("timing"):
                return self._fastest(region, spec, outcomes, built, plan, tail)
        first = _first_fit(configs, outcomes)
        if first is not None:
            return Choice("triton", first, outcomes[first].binary,
                          note=f"[{first}] ({self.mode}, untimed, "
                          f"{len(outcomes)} of {len(configs)} configs tried){tail}")
        return Choice("extern", note=f"no Triton config of kernel {spec.name} compiled and "
                      f"fit {self.target}: {failed or 'no candidates'}")

    def _fastest(self, region, spec, outcomes, built, plan, tail) -> Choice:
        env = timing_env(plan, self.example_env)
        low = low_env(region, plan, env)
        runs = self._runs(region, spec, plan, env)
        low_runs = None if low is None else self._runs(region, spec, plan, low)
        faults: list[str] = []
        try:
            # a prompt-length dim's matmul or attention adds host cost at 128 rows only
            # (_confirmed_at_top): at 512 and 2048 a prefill is GPU-bound
            host = host_exposed(region, plan) and top_env(region, plan, env) is None
            times, pruned = self._time_all(runs, region, spec, outcomes, built, faults, host)
            low_times, low_pruned = (None, set()) if low is None else self._time_all(
                low_runs, region, spec, outcomes, built, faults, host)
        except NoRunWorker as e:  # nothing can be timed: decide as without a GPU
            first = built[0]
            return Choice("triton", first, outcomes[first].binary, final=False,
                          note=f"[{first}] ({self.mode}, untimed: {e}){tail}")
        note = f"timed ({self.mode}): {_summary(times)}"
        if host:
            note += f" ({host_cost.describe(region)})"
        if low_times is None:
            top = top_env(region, plan, env)
            if top is not None:
                return self._confirmed_at_top(region, spec, outcomes, plan, (runs, times,
                                              pruned), env, top, note, tail, faults)
            return self._winner(runs, spec, outcomes, times, times, note + tail
                                + "".join(faults))
        tail += "".join(faults)
        note += f"; at the batch's low end: {_summary(low_times)}{tail}"
        # a decode batch's both ends: the candidate whose worse end is nearest the
        # fastest there wins (its score, a ratio, ranks like a time in _verified) ...
        scores = worst_ratio(times, low_times)
        if one_serves_both(scores) or math.isinf(min(scores.values())):
            return self._winner(runs, spec, outcomes, scores, times, note)
        # ... unless none is near it at both: each end its own winner (both_ends.py)
        top = self._winner(runs, spec, outcomes, times, times, "")
        bottom = self._winner(low_runs, spec, outcomes, low_times, low_times, "")
        # where the two winners' times cross is read from each at the other's end too:
        # a screen's time there is made a full one (the same note lists the screens')
        for c, at, at_times, at_pruned in ((_key(bottom), runs, times, pruned),
                                           (_key(top), low_runs, low_times, low_pruned)):
            if c in at_pruned:
                at_times[c] = self._full_ms(at, spec, c, outcomes, faults)
                if host:  # scored as its peers are
                    at_times[c] = with_host_cost({c: at_times[c]}, region)[c]
        return _per_end(bottom, top, low_times, times, low, env, note)

    def _confirmed_at_top(self, region, spec, outcomes, plan, at_env, env, top, note,
                          tail, faults) -> Choice:
        """A prompt-length dim's choice: the candidates within FINALIST_RATIO of the
        fastest at `env` (TUNE_SIZE rows) and the torch form timed again at `top`
        (timing.TOP_SIZE) and at timing.BOTTOM_SIZE; one that is within SWITCH_GAIN of
        the fastest at every size wins, else each end keeps its own winner, as a decode
        batch's ends do (both_ends.py): the best worst case over BOTTOM_SIZE and
        TUNE_SIZE below where its time and the top winner's cross, the top's above."""
        runs, times, pruned = at_env
        best = min(times.values())
        finalists = [c for c in times if c is not None and not math.isinf(times[c])
                     and times[c] <= FINALIST_RATIO * best]
        top_runs = self._runs(region, spec, plan, top)
        sustained = power_cap.worth_sustaining(times)
        top_times, top_pruned = self._time_all(top_runs, region, spec, outcomes,
                                               finalists, faults, sustained=sustained)
        how = f" ({power_cap.describe()})" if sustained else ""
        note += f"; finalists at {_sizes(top, env)}{how}: {_summary(top_times)}"
        top_times = {c: top_times.get(c, math.inf) for c in times}
        low_scores, bottom_times = times, None
        bottom = bottom_env(region, plan, env)
        if bottom is not None:
            host = host_exposed(region, plan)
            bottom_times, _ = self._time_all(self._runs(region, spec, plan, bottom), region,
                                             spec, outcomes, finalists, faults, host)
            note += f"; at {_sizes(bottom, env)}: {_summary(bottom_times)}"
            if host:
                note += f" ({host_cost.describe(region)})"
            bottom_times = {c: bottom_times.get(c, math.inf) for c in times}
            if all(math.isinf(t) for t in bottom_times.values()):
                bottom_times = None  # none ran there: 512 speaks for short prompts
            else:
                low_scores = worst_ratio(times, bottom_times)
        tail += "".join(faults)
        if all(math.isinf(t) for t in top_times.values()):  # none ran there: 512 decides
            return self._winner(runs, spec, outcomes, low_scores, times, note + tail)
        scores = worst_ratio(top_times, times, *([bottom_times] if bottom_times else []))
        if one_serves_both(scores) or math.isinf(min(scores.values())):
            return self._winner(runs, spec, outcomes, scores, times, note + tail)
        low = self._winner(runs, spec, outcomes, low_scores, times, "")
        high = self._winner(top_runs, spec, outcomes, top_times, top_times, "")
        for c, at, at_times, at_pruned, budget in (
                (_key(low), top_runs, top_times, top_pruned,
                 power_cap.SUSTAINED if sustained else None),
                (_key(high), runs, times, pruned, None)):
            if c in at_pruned or math.isinf(at_times[c]):
                at_times[c] = self._full_ms(at, spec, c, outcomes, faults, budget)
        if bottom_times is None:
            return _per_end(low, high, times, top_times, env, top, note + tail)
        return _prompt_switch(low, high, (bottom_times, times, top_times), (bottom, env, top),
                              note + tail)

    def _full_ms(self, runs, spec, c, outcomes, faults, budget=None) -> float:
        ran = self._ran(runs, spec, c, outcomes[c].binary if c else None, faults, budget)
        return math.inf if ran.value is None else float(ran.value)

    def _winner(self, runs, spec, outcomes, scores, times, note) -> Choice:
        """The candidate ranked first by `scores` whose outputs match the torch form's
        (`times`: the ms it is given), or the extern form."""
        best = min(scores, key=scores.get)
        if math.isinf(scores[best]):
            return Choice("extern", note=f"no candidate of kernel {spec.name} ran: {note}")
        if best is None:
            return Choice("extern", ms=times[None], note=f"extern is fastest; {note}")
        try:
            best, verdict = self._verified(runs, spec, outcomes, scores)
        except Exception as e:  # checking must not cost the compile: keep the race's winner
            log.info("%s: outputs not verified: %s", spec.name, e)
            verdict = f"; not verified: {type(e).__name__}: {e}"
        if best is None:
            return Choice("extern", ms=times[None], note=f"{verdict}; {note}")
        return Choice("triton", best, outcomes[best].binary, times[best],
                      f"[{best}] {note}{verdict}")

    def _time_all(self, runs, region, spec, outcomes, built, faults, host=False,
                  sustained=False):
        """(each built candidate's median ms and the torch form's (key None), those
        timed by a screen alone): screen.py; far slower than the fastest, they lose.
        `host`: each gets its host cost added (host_cost.py). `sustained`: each timed
        at the power cap, unscreened (power_cap.py)."""
        with progress(total=len(built) + 1, desc=f"time {region.name}", unit="config") as bar:
            def measure(c, budget):
                ran = self._ran(runs, spec, c, outcomes[c].binary if c else None, faults,
                                budget)
                if budget in (SCREEN, power_cap.SUSTAINED):  # one step a candidate
                    bar.update(1)
                return (math.inf if ran.value is None else float(ran.value)), ran.samples

            timed = sustained_times if sustained else screened_times
            times, pruned = timed(measure, [*built, None])
        if host:
            times = with_host_cost(times, region)
        return times, pruned

    def _runs(self, region, spec, plan, env):
        """Where candidates run: the run worker, or (KILN_TUNE_TIMING=inprocess) here."""
        fill = spec.meta.get("timing_fill")
        if self.timing == "inprocess":
            return _InProcessRuns(region, spec, plan, env, self.target.torch_device, fill)
        return IsolatedRuns(region, spec, buffer_specs(region, plan, env, fill), env,
                            self.runner, self.run_timeout)

    def _ran(self, runs, spec, config, binary, faults: list[str], budget=None) -> Ran:
        """A candidate's run (a fault quarantines it; a failure is logged)."""
        ran = runs.time(config, binary, budget)
        if ran.fault is not None:
            self._faulted(spec, config, ran.fault, faults)
        elif ran.error is not None:
            log.info("timing %s failed: %s", config or "extern", ran.error)
        return ran

    def _faulted(self, spec, config, why: str, faults: list[str]) -> None:
        """Record that running `config` faulted (config None: the torch form, no record)."""
        faults.append(f"; [{config or 'extern'}] {q.RUNTIME_FAULT}: {why}")
        log.warning("%s [%s]: faulted while running: %s", spec.name, config or "extern", why)
        if config is not None:
            self.quarantine.record(q.FailureKey.of(spec, config, self.target),
                                   q.RUNTIME_FAULT, why, spec.name, self.compile_fn)

    def _verified(self, runs, spec, outcomes, times):
        """(the fastest candidate whose outputs match the extern form's, a note).

        Candidates faster than it that mismatched are quarantined as wrong, and those
        that faulted as runtime_fault. When none of those that ran matches, the inputs
        are taken to be at fault (verify.py) and the fastest of them wins.
        """
        ranked = sorted((c for c in times if c is not None and not math.isinf(times[c])),
                        key=times.get)
        if math.isinf(times[None]):
            return ranked[0], "; not verified: the torch form did not run"
        wrong, faults = [], []
        for c in ranked:
            if times[None] <= times[c]:  # slower than the extern form: extern wins
                break
            ran = runs.verify(c, outcomes[c].binary)
            if ran.fault is not None:
                self._faulted(spec, c, ran.fault, faults)
                continue
            if ran.error is not None:
                raise RuntimeError(ran.error)
            if ran.value is None:
                for w, reason in wrong:
                    self.quarantine.record(q.FailureKey.of(spec, w, self.target), q.WRONG,
                                           reason, spec.name, self.compile_fn)
                    log.warning("%s [%s]: wrong outputs: %s", spec.name, w, reason)
                return c, "".join(f"; [{w}] wrong: {r}" for w, r in wrong) + "".join(faults)
            wrong.append((c, ran.value))
        faulted = "".join(faults)
        if not wrong:
            return None, f"extern: no candidate faster than it ran its check{faulted}"
        if len(wrong) == len(ranked) - len(faults):
            return wrong[0][0], ("; no candidate matched the torch form on random inputs "
                                 f"(taken as ill-conditioned inputs): {wrong[0][1]}{faulted}")
        return None, ("extern: every candidate faster than it mismatched: "
                      + "; ".join(f"[{w}] {r}" for w, r in wrong) + faulted)


class _InProcessRuns:
    """KILN_TUNE_TIMING=inprocess: candidates run in the compiling process, on one set of
    buffers (a fault here poisons this process's CUDA context: for debugging only)."""

    def __init__(self, region, spec, plan, env, device, fill):
        self.region, self.spec, self.env, self.device = region, spec, env, device
        self.inputs, self.outs = example_buffers(region, plan, env, device, fill)
        self._want = None
        self._timed: dict = {}  # config -> ms

    def _kernel(self, config, binary):
        if config is None:
            return TorchKernel(self.region, self.device)
        return TritonKernel(self.region, self.spec, config, binary)

    def time(self, config, binary, budget=None) -> Ran:
        """One full timing a candidate, whatever the budget (a screen and its rest
        read it twice): debugging favours the plain measurement over the saving."""
        if config not in self._timed:
            self._timed[config] = bench(self._kernel(config, binary), self.inputs,
                                        self.outs, self.env)
        return Ran(self._timed[config])

    def verify(self, config, binary) -> Ran:
        inplace = inplace_inputs(self.region)
        if self._want is None:
            self._want = outputs(TorchKernel(self.region, self.device, zeroed=True),
                                 self.inputs, self.outs, self.env, inplace)
        got = outputs(self._kernel(config, binary), self.inputs, self.outs, self.env, inplace)
        return Ran(mismatch(got, self._want))


def _check_compiler(path: str, what: str = "tune compiler",
                    call: str = "fn(spec, config, target)") -> None:
    """The workers import `path`; a wrong one is the user's error, named here, once."""
    module, _, fn = str(path).partition(":")
    if not module or not fn:
        raise KilnError(f"{what} {path!r} is not an import path",
                        hint="write it as 'package.module:function'")
    try:
        found = callable(resolve(path))
    except (ImportError, AttributeError) as e:
        raise KilnError(f"{what} {path!r} cannot be imported: {e}",
                        hint="name a function importable from the current directory or "
                        f"PYTHONPATH, called as {call}") from None
    if not found:
        raise KilnError(f"{what} {path!r} is not a function")


def _first_fit(configs: list[Config], outcomes: dict[Config, Outcome]) -> Config | None:
    """The first config in order that compiled and fits, once every earlier one is known."""
    for c in configs:
        out = outcomes.get(c)
        if out is None:
            return None
        if out.status == OK:
            return c
    return None


def _all_permanent(outcomes: dict[Config, Outcome]) -> bool:
    """Whether every failure will recur (so an extern decision may be cached)."""
    return all(o.status in q.NEVER_RETRIED for o in outcomes.values())


def _sizes(at: dict[str, int], env: dict[str, int]) -> str:
    """The sizes of `at` that differ from `env`'s, as a note names them."""
    return ", ".join(f"{k}={v}" for k, v in sorted(at.items()) if env.get(k) != v)


def _summary(times: dict) -> str:
    return ", ".join(f"[{c}] {t:.4f} ms" if c else f"extern {t:.4f} ms"
                     for c, t in times.items())


def _per_end(bottom: Choice, top: Choice, low_times: dict, times: dict,
             low: dict[str, int], env: dict[str, int], note: str) -> Choice:
    """The low end's winner `bottom` and the top's `top` as one choice: a switch between
    them (at both_ends.switch_point), or the one that alone serves both ends."""
    lo, hi = _key(bottom), _key(top)
    at = None if lo == hi else switch_point((low_times[lo], times[lo]),
                                            (low_times[hi], times[hi]))
    if at is None:  # one winner (checking outputs can make it so), or one near enough
        scores = worst_ratio(times, low_times)
        one = top if scores[hi] <= scores[lo] else bottom
        return Choice(one.kind, one.config, one.binary, one.ms,
                      f"{one.note.rstrip('; ')}; {note}")
    return _switch(bottom, top, low_sizes(low, env, at), note)


def _prompt_switch(low: Choice, high: Choice, times: tuple, envs: tuple, note: str) -> Choice:
    """A prompt dim's two winners as one choice, from their times at three sizes
    (BOTTOM_SIZE, TUNE_SIZE, TOP_SIZE; `envs` those sizes): where the low winner still
    wins at TUNE_SIZE the switch falls between it and the top (as _per_end's); where
    the top's winner is as fast at TUNE_SIZE, between BOTTOM_SIZE and TUNE_SIZE, if the
    low winner wins at the bottom; else one of the two serves every size."""
    (bt, t, tt), (bottom, env, top) = times, envs
    lo, hi = _key(low), _key(high)
    one = low
    if lo != hi:
        at = switch_point((t[lo], tt[lo]), (t[hi], tt[hi]))
        if at is not None:
            return _switch(low, high, low_sizes(env, top, at), note)
        if tt[lo] > tt[hi] * (1 + SWITCH_GAIN):  # loses the top, ties at TUNE_SIZE
            if bt[hi] > bt[lo] * (1 + SWITCH_GAIN):  # ... and wins the bottom
                at = switch_point((bt[lo], t[lo]), (bt[hi], t[hi]))
                return _switch(low, high, low_sizes(bottom, env, 1.0 if at is None else at),
                               note)
            one = high
    return Choice(one.kind, one.config, one.binary, one.ms, f"{one.note.rstrip('; ')}; {note}")


def _switch(low: Choice, high: Choice, sizes: dict[str, int], note: str) -> Choice:
    switch = ", ".join(f"{s} <= {n}" for s, n in sorted(sizes.items()))
    return Choice("switch", ms=high.ms, low=low, high=high, low_sizes=sizes,
                  note=f"switch on size: {switch} runs {_named(low)}, larger sizes "
                  f"{_named(high)}; {note}")


def _key(c: Choice):
    """The key of a choice's times: its config, or None for the extern form."""
    return c.config if c.kind == "triton" else None


def _named(c: Choice) -> str:
    """A choice's candidate, and what checking its outputs found, if anything."""
    name = f"[{c.config}]" if c.kind == "triton" else "extern"
    found = c.note.removeprefix(name).removeprefix(" is fastest").strip("; ")
    return f"{name} ({found})" if found else name
