"""Plain-text summaries of a tuning result: a short one, and the report with advice.

NOTE [ Headline rates ]
The report's throughput, baseline and speedup are the objective the settings were
chosen by: samples per second over a training epoch, worker start-up included
(``NOTE [ Epoch model ]``), the figures :func:`autoloader.plot` draws too. Where the
steady rates (start-up excluded) differ from them by more than ``_SAME_RATE``, they are
shown beside them with the start-up that makes the difference, labelled each epoch
(workers not persistent) or once (persistent workers). The step's ceiling is a steady
rate, so the share of it the loop reaches is the steady rate's.

NOTE [ Advice ]
Every line of advice quotes a figure measured in the same run, and is given only when
that figure says it applies:

- batched fetch: the best trial fetching whole batches against the best one fetching
  item by item;
- copy-on-read: the private memory a forked process gains per item it reads (see
  ``NOTE [ Copy-on-read probe ]``), times the items of an epoch;
- ``/dev/shm``: the bytes of batches the tuned setting keeps in flight (batch bytes x
  prefetch x workers) against the size of ``/dev/shm``;
- a loader slower than the step even at the best setting: the two times per batch,
  and the dataset's size as tensors, which may fit on the accelerator where there is
  one, or in memory;
- workers repeating each other's randomness: two workers' first reads of item 0 gave
  the same random result (``TuneResult.facts``).

Each distinct reason a setting failed (or was pruned for memory) is listed once, with
the worker counts that met it: a pipeline that fails from some worker count on (fewer
shards than workers, a file-descriptor limit) shows it at a glance. Settings pruned as
slower, or too short to measure, did not fail and are not listed.
"""

from __future__ import annotations

import re
import statistics
import textwrap
from collections.abc import Iterator

from autoloader.checks import copied_per_worker
from autoloader.loader import BASELINE_PARAMS, TUNED_KEYS
from autoloader.measure import format_bytes, format_seconds
from autoloader.results._record import TrialRecord
from autoloader.results._result import TuneResult
from autoloader.search import FaultKind, step_competes_with_workers

# Share of /dev/shm that batches in flight may fill before it is worth a word.
_SHM_SHARE = 0.25
# Share of the loop's time waiting for data above which the loader is still the limit.
_STILL_WAITING = 0.2
# Above this ratio, batched fetch is worth telling about.
_BATCHED_GAIN = 1.1
# Rates within this fraction of each other are shown as one (``NOTE [ Headline rates ]``).
_SAME_RATE = 0.02


def describe(record: TrialRecord) -> str:
    """One line for the log: the setting and what it measured."""
    p = record.params
    setting = f"num_workers={p.get('num_workers')}"
    if p.get("num_workers"):
        setting += f" prefetch={p.get('prefetch_factor')} persistent={p.get('persistent_workers')}"
    if p.get("pin_memory"):
        setting += " pin_memory=True"
    setting += "".join(f" {name}={value}" for name, value in _unusual(p))
    if record.state != "complete":
        return f"trial {record.number} [{record.phase}] {setting}: {record.state} ({record.reason})"
    rate = _rate(record)
    steady = record.samples_per_second
    if steady is not None and _differs(steady, rate):
        rates = f"{rate:.0f} samples/s over an epoch ({steady:.0f} steady)"
    else:
        rates = f"{rate:.0f} samples/s"
    wait = record.data_wait_fraction or 0.0
    memory = format_bytes(record.peak_memory or 0)
    return (
        f"trial {record.number} [{record.phase}] {setting}: {rates}, "
        f"waits {wait:.0%} for data, peak {memory}"
    )


# Settings shown only when they differ from DataLoader's usual behaviour.
_USUAL = {
    "batched_fetch": False,
    "worker_threads": None,
    "in_order": True,
    "worker_kind": "processes",
    "step_threads": None,
}


def _unusual(params: dict[str, object]) -> list[tuple[str, str]]:
    return [
        (name, str(params[name]))
        for name, usual in _USUAL.items()
        if name in params and params[name] != usual
    ]


def _ratio(result: TuneResult) -> str:
    """The speedup over the defaults, or where they timed no batch, that there is none."""
    return f"{result.speedup:.2f}x" if result.baseline > 0 else "no ratio (they timed no batch)"


def report(result: TuneResult) -> str:
    """A readable report of ``result`` (what ``autoloader show`` prints): the settings
    against the defaults, the speedup, the bottleneck, and advice, each line backed by
    a figure measured in the run.

    Example::

        result = autoloader.tune(dataset, train_step, batch_size=64)
        print(autoloader.report(result))
    """
    env = result.environment
    chosen = result.chosen_trial
    baseline = _baseline(result)
    lines = [
        f"autoloader report: batch size {result.batch_size}, measured on "
        f"{env.usable_cpus} CPUs, {format_bytes(env.memory_total)}, torch "
        f"{env.torch_version}, {env.accelerator or 'no accelerator'}"
        + (" (interrupted: best of the finished trials)" if result.partial else ""),
        "",
        f"{'setting':<20} {'tuned':>9} {'default':>9}",
    ]
    for name in TUNED_KEYS:
        value, default = result.params.get(name), BASELINE_PARAMS.get(name)
        mark = "" if value == default else "  <"
        lines.append(f"{name:<20} {_show(value):>9} {_show(default):>9}{mark}")
    lines.append("")
    rows = [
        (
            "throughput",
            f"{result.throughput:,.0f} samples/s over an epoch, start-up included, against "
            f"{result.baseline:,.0f} with the defaults: {_ratio(result)}",
        ),
        *_steady_rows(result),
        *_worker_start_row(result),
        *_cores_row(result),
    ]
    if baseline and chosen and baseline.data_wait_fraction is not None:
        rows.append(
            (
                "waiting for data",
                f"{baseline.data_wait_fraction:.0%} of the loop's time with the defaults, "
                f"{chosen.data_wait_fraction or 0:.0%} tuned",
            )
        )
    bottleneck = _bottleneck(result, baseline)
    if bottleneck:
        rows.append(("bottleneck", bottleneck))
    if chosen and chosen.peak_memory:
        rows.append(
            (
                "peak memory",
                f"{format_bytes(chosen.peak_memory)} (process tree, tuned), budget "
                f"{format_bytes(result.memory_budget)}" + _memory_saved(result, chosen),
            )
        )
    states = [t.state for t in result.trials]
    too_short = sum(t.too_short for t in result.trials)
    rows.append(
        (
            "trials",
            f"{len(states)} run, {states.count('pruned')} pruned"
            + (f" ({too_short} too short to measure)" if too_short else "")
            + f", {states.count('failed')} failed, in {result.tuning_seconds:.0f} s",
        )
    )
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        lines.extend(_wrapped(value, first=f"{name:<{width}}  ", rest=" " * (width + 2)))
    failed = list(failures(result))
    if failed:
        lines += ["", "failures"]
        for line in failed:
            lines.extend(_wrapped(line, first="- ", rest="  "))
    advice = list(advise(result))
    if advice:
        lines += ["", "advice"]
        for line in advice:
            lines.extend(_wrapped(line, first="- ", rest="  "))
    missing = result.facts.get("missing") or {}
    notes = [
        *result.notes,
        *(f"not checked, {_CHECKS.get(name, name)}: {why}" for name, why in missing.items()),
    ]
    if notes:
        lines += ["", "notes"]
        for note in notes:
            lines.extend(_wrapped(note, first="- ", rest="  "))
    return "\n".join(lines)


def _cores_row(result: TuneResult) -> list[tuple[str, str]]:
    """How the tuned settings share the CPUs: the training process's torch threads, and
    the CPUs they leave the workers (``NOTE [ Step threads ]``)."""
    threads = result.params.get("step_threads")
    if threads is None:
        return []
    cpus = result.environment.usable_cpus
    workers = result.params["num_workers"]
    if not workers:
        who = "no workers (loading runs in the training process)"
    elif result.params.get("worker_kind") == "threads":
        who = f"{workers} worker thread{'s' if workers != 1 else ''}"
    else:
        who = f"{workers} worker process{'es' if workers != 1 else ''}"
    return [
        (
            "cores",
            f"the step on {threads} torch thread{'s' if threads != 1 else ''}, leaving "
            f"{max(0, cpus - threads)} of {cpus} CPUs to {who}: apply it with "
            "result.apply_threads() (a loader cannot carry it)",
        )
    ]


# What each check before the search establishes (``TuneResult.facts["missing"]``).
_CHECKS = {
    "batched_fetch": "whether whole batches can be fetched at once",
    "random_items": "whether items are random",
    "workers_repeat_randomness": "whether workers repeat each other's randomness",
    "worker_start": "how long a worker process takes to start",
    "copy_on_read": "copy-on-read in forked workers",
    "repeated_samples": "whether workers repeat each other's samples",
    "threads": "whether thread workers read the dataset as one thread does",
}


# Parts of a failure's reason that differ between trials that met the same fault.
_WORKER_NUMBER = re.compile(r"(worker process )\d+")
_NOT_RUN_AGAIN = re.compile(r" \(not run: [^)]*\)$")
_SIZE = re.compile(r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b")


def failures(result: TuneResult) -> Iterator[str]:
    """Each distinct reason settings failed or were pruned for, with the settings that met
    it (see ``NOTE [ Advice ]``)."""
    groups: dict[str, tuple[str, list[TrialRecord]]] = {}
    for trial in result.trials:
        if trial.state == "complete" or not trial.reason or trial.kind == "slower":
            continue
        if trial.too_short:  # counted with the trials: out of time, not broken
            continue
        shown = _NOT_RUN_AGAIN.sub("", _WORKER_NUMBER.sub(r"\1N", trial.reason))
        groups.setdefault(_SIZE.sub("#", shown), (shown, []))[1].append(trial)
    for shown, trials in groups.values():
        workers = sorted({int(t.params.get("num_workers", 0)) for t in trials})
        count = f"{len(trials)} trial{'s' if len(trials) > 1 else ''}"
        yield f"{shown}: {count}, num_workers {', '.join(map(str, workers))}"


def advise(result: TuneResult) -> Iterator[str]:
    """Advice lines, each backed by a figure of this run (see ``NOTE [ Advice ]``)."""
    for advice in (
        _batched_fetch_advice,
        _copy_on_read_advice,
        _shared_memory_advice,
        _still_waiting_advice,
        _randomness_advice,
        _persistent_advice,
    ):
        yield from advice(result)


# Worker start-up per epoch worth a word: this many seconds, and this share of an epoch.
_RESTART_WORTH_SECONDS = 0.5
_RESTART_WORTH_SHARE = 0.02


def _persistent_advice(result: TuneResult) -> Iterator[str]:
    """Where the chosen workers start again every epoch, and that costs seconds."""
    params = result.params
    workers = params.get("num_workers") or 0
    each = result.facts.get("worker_start_seconds")
    length = result.facts.get("dataset_length")
    if not workers or params.get("worker_kind") == "threads" or params.get("persistent_workers"):
        return
    if each is None or not length or not result.throughput:
        return
    restart = each * workers
    epoch = length / result.throughput
    if restart < _RESTART_WORTH_SECONDS or restart < _RESTART_WORTH_SHARE * epoch:
        return
    method = result.facts.get("start_method") or "?"
    yield (
        f"The {workers} workers start again every epoch: about {restart:.1f} s an epoch here "
        f"({each:.2f} s a worker, {method}), {restart / epoch:.0%} of an epoch of about "
        f"{epoch:.0f} s. persistent_workers=True starts them once per training run and "
        "keeps them (and the memory they hold) between epochs."
    )


def _batched_fetch_advice(result: TuneResult) -> Iterator[str]:
    complete = [t for t in result.trials if t.state == "complete" and t.samples_per_second]
    batched = [t for t in complete if t.params.get("batched_fetch")]
    one_by_one = [t for t in complete if not t.params.get("batched_fetch")]
    if batched and one_by_one:
        fast = max(batched, key=_rate)
        slow = max(one_by_one, key=_rate)
        if _rate(fast) >= _BATCHED_GAIN * _rate(slow):
            yield (
                f"The dataset can be indexed a batch at a time, and fetching whole batches "
                f"is {_rate(fast) / _rate(slow):.1f}x faster than item by item plus "
                f"collate ({_rate(fast):,.0f} against {_rate(slow):,.0f} samples/s, the "
                "best of each). make_loader() does it; for your own DataLoader use "
                "loader_kwargs(dataset)."
            )


def _copy_on_read_advice(result: TuneResult) -> Iterator[str]:
    facts = result.facts
    per_worker = copied_per_worker(facts)
    if per_worker is not None and result.params.get("worker_kind") != "threads":
        workers = result.params["num_workers"]
        line = (
            f"Workers copy the dataset as they read it: a forked process gained "
            f"{format_bytes(facts['copy_on_read'])} of private memory per item it read for "
            f"the first time ({facts['copy_on_read_items']:,} items measured), so over an "
            f"epoch of {facts['dataset_length']:,} items each worker can end up with about "
            f"{format_bytes(per_worker)} of its own"
        )
        if workers:
            line += f" ({format_bytes(per_worker * workers)} for the tuned {workers} workers)"
        yield line + (
            ". Reading a Python object writes its reference count, which copies its page. "
            "Store the dataset as numpy arrays or tensors instead of lists of Python "
            "objects."
        )


def _shared_memory_advice(result: TuneResult) -> Iterator[str]:
    chosen, facts = result.chosen_trial, result.facts
    shm = facts.get("shm_bytes")
    if chosen and shm and chosen.batch_bytes and result.params["num_workers"]:
        workers = result.params["num_workers"]
        prefetch = result.params["prefetch_factor"] or 2
        in_flight = chosen.batch_bytes * prefetch * workers
        if in_flight >= _SHM_SHARE * shm:
            yield (
                f"/dev/shm is {format_bytes(shm)} and the tuned setting keeps up to "
                f"{format_bytes(in_flight)} of batches in flight there "
                f"({format_bytes(chosen.batch_bytes)} per batch x prefetch {prefetch} x "
                f"{workers} workers). Give it more room (in Docker: --shm-size), or "
                "lower prefetch_factor, or workers fail with bus errors or 'No space left "
                "on device'."
            )
    shm_failures = [t for t in result.trials if t.kind == FaultKind.SHARED_MEMORY.value]
    if shm_failures:
        yield (
            f"{len(shm_failures)} trial(s) failed on shared memory (/dev/shm is "
            f"{format_bytes(shm or 0)}): give it more room (in Docker: --shm-size)."
        )


def _still_waiting_advice(result: TuneResult) -> Iterator[str]:
    chosen, facts = result.chosen_trial, result.facts
    if (
        chosen
        and (chosen.data_wait_fraction or 0) >= _STILL_WAITING
        and chosen.step_seconds
        and chosen.load_seconds
    ):
        line = (
            f"Even with the best setting the loop waits for data "
            f"{chosen.data_wait_fraction:.0%} of the time: {_ms(chosen.load_seconds)} per "
            f"batch on top of the step's {_ms(chosen.step_seconds)}."
        )
        length = facts.get("dataset_length")
        if length and chosen.batch_bytes:
            size = chosen.batch_bytes / result.batch_size * length
            line += (
                f" As tensors the whole dataset is about {format_bytes(size)} "
                f"({format_bytes(chosen.batch_bytes)} per batch of {result.batch_size}, "
                f"{length:,} items): "
            )
            if result.environment.accelerator:
                line += (
                    "if that fits in the accelerator's memory, preload it there once and "
                    "index batches on the device; else store it decoded, so loading is a "
                    "read."
                )
            else:
                line += (
                    "if that fits in memory, decode it once into tensors (a TensorDataset, "
                    "which batched fetch then indexes a batch at a time); else store it "
                    "decoded, so loading is a read."
                )
        yield line


def _randomness_advice(result: TuneResult) -> Iterator[str]:
    if result.facts.get("workers_repeat_randomness"):
        yield (
            "Workers repeat each other's randomness: item 0 read first in two workers "
            "gave the same random result, while two reads in this process differ. The "
            "dataset holds its own random generator, copied into every worker. Re-seed "
            "it per worker in a worker_init_fn, e.g. "
            "info = torch.utils.data.get_worker_info(); "
            "info.dataset.rng = np.random.default_rng(info.seed)."
        )


def _bottleneck(result: TuneResult, baseline: TrialRecord | None) -> str | None:
    if not baseline or baseline.load_seconds is None or not baseline.step_seconds:
        return None
    load, step = baseline.load_seconds, baseline.step_seconds
    if baseline.data_wait_fraction is not None and baseline.data_wait_fraction < 0.05:
        return (
            f"the step: with the defaults the loop already waits for data only "
            f"{baseline.data_wait_fraction:.0%} of the time (step {_ms(step)} per batch)"
        )
    cpu = (baseline.load_cpu_seconds or 0.0) / load if load else 0.0
    kind = "CPU work" if cpu > 0.5 else "mostly waiting on I/O"
    step_cpu, load_cpu = _step_cpu(result, baseline), baseline.load_cpu_seconds or 0.0
    cpus = result.environment.usable_cpus
    if step_competes_with_workers(
        step=step, step_cpu=step_cpu, load_cpu=load_cpu, loading_cpu_share=cpu, usable_cpus=cpus
    ):
        workers = result.params["num_workers"]
        return (
            f"the CPU, shared by the step and loading: with the defaults the step kept "
            f"{step_cpu / step:.1f} of the {cpus} CPUs busy for {_ms(step)} per batch, and "
            f"loading took {_ms(load_cpu)} of CPU work. Workers take cores from the step"
            + (
                "; tuned, loading stays in the main process"
                if not workers
                else f"; tuned, {workers} worker{'s' if workers > 1 else ''} measured faster"
            )
        )
    text = (
        f"loading: with the defaults a batch took {_ms(load)} to load ({kind}, "
        f"{min(cpu, 1.0):.0%} of it on the CPU), the step {_ms(step)}"
    )
    ceiling = result.step_ceiling
    if ceiling:
        steady = result.steady_throughput or result.throughput
        text += (
            f"; tuned, the loop's steady rate reaches {steady / ceiling:.0%} of the step's "
            f"ceiling of {ceiling:,.0f} samples/s"
        )
    return text


def _steady_rows(result: TuneResult) -> list[tuple[str, str]]:
    """The steady rates and the start-up, where the steady rates differ from the
    headline's (see ``NOTE [ Headline rates ]``)."""
    steady, steady_baseline = result.steady_throughput, result.steady_baseline
    if steady is None or steady_baseline is None:
        return []
    if not (_differs(steady, result.throughput) or _differs(steady_baseline, result.baseline)):
        return []
    speedup = f": {steady / steady_baseline:.2f}x" if steady_baseline > 0 else ""
    rows = [
        (
            "steady rate",
            f"{steady:,.0f} samples/s once started, against {steady_baseline:,.0f} with the "
            f"defaults{speedup}",
        )
    ]
    seconds = result.startup_seconds
    if seconds is not None:
        start = (
            "to start the workers and load the first batch"
            if result.params.get("num_workers")
            else "to load the first batch"
        )
        if result.startup_each_epoch:
            when = f"each epoch {start} (workers not persistent), counted in the throughput"
        else:
            when = (
                f"once per training run {start} (persistent workers), not counted in the "
                "throughput: later epochs only refill the pipeline"
            )
        rows.append(("start-up", f"{seconds:.2f} s {when}"))
    return rows


def _worker_start_row(result: TuneResult) -> list[tuple[str, str]]:
    """The start-up of one worker process, as measured before the search."""
    seconds = result.facts.get("worker_start_seconds")
    if seconds is None:
        return []
    method = result.facts.get("start_method") or "?"
    bound = "more than " if result.facts.get("worker_start_at_least") else ""
    return [
        (
            "worker start",
            f"{bound}{seconds:.2f} s to start one worker process ({method}) and get its "
            "first item, measured before the search",
        )
    ]


def _differs(rate: float, headline: float) -> bool:
    return abs(rate - headline) > _SAME_RATE * abs(headline)


def _step_cpu(result: TuneResult, baseline: TrialRecord) -> float:
    """The step's CPU seconds per batch: from the trials with workers, where no loading
    ran in this process to spin its threads into the step (see ``NOTE [ Spinning
    threads ]``), else the baseline's."""
    clean = [
        t.step_cpu_seconds
        for t in result.trials
        if t.state == "complete" and t.params.get("num_workers") and t.step_cpu_seconds is not None
    ]
    return statistics.median(clean) if clean else baseline.step_cpu_seconds or 0.0


def _memory_saved(result: TuneResult, chosen: TrialRecord) -> str:
    """With thread workers tuned: the memory they save against the fastest setting with
    worker processes, which copy what threads share (``""`` if they save none)."""
    if result.params.get("worker_kind") != "threads" or not chosen.peak_memory:
        return ""
    processes = [
        t
        for t in result.trials
        if t.state == "complete"
        and t.params.get("num_workers")
        and t.params.get("worker_kind", "processes") == "processes"
        and t.peak_memory
    ]
    if not processes:
        return ""
    best = max(processes, key=_rate)
    saved = (best.peak_memory or 0) - chosen.peak_memory
    if saved <= 0:
        return ""
    return (
        f"; {format_bytes(saved)} less than the fastest setting with worker processes "
        f"({best.params['num_workers']} processes: {format_bytes(best.peak_memory or 0)}, "
        f"{_rate(best):,.0f} samples/s)"
    )


def _baseline(result: TuneResult) -> TrialRecord | None:
    matches = [t for t in result.trials if t.state == "complete" and t.phase == "baseline"]
    return matches[0] if matches else None


def _rate(record: TrialRecord) -> float:
    return record.epoch_samples_per_second or record.samples_per_second or 0.0


def _show(value: object) -> str:
    return "-" if value is None else str(value)


_ms = format_seconds


def _wrapped(text: str, *, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, width=92, initial_indent=first, subsequent_indent=rest)
