"""The `stream` rollout: partial rollouts (`generation.partial_rollout: true`) from a streaming generator.

Why: with long-tailed responses a synchronous step decodes its batch until the longest response ends,
and the decode pool empties as rows finish. The streaming generator keeps the continuous engine's pool
full instead: it admits the prompts of the next steps as groups finish (`models.streaming`), hands the
trainer each step's batch when its last group is done, and applies new weights at the next decode chunk
while the rows in flight go on with their KV cache (partial rollouts, as AReaL and verl's asynchronous
trainer do), or with a cache recomputed under the new weights (`generation.partial_recompute`). Every
token records the weight version (trainer updates) that sampled it. With reward workers
(`rewards.workers`) each sample is scored as soon as it ends.

Staleness is enforced by admission pacing, never by discarding work: batches are trained in admission
order (prompt k of the run belongs to step k // B + 1, B = data.batch_size), and a step's prompts are
admitted only once the generator holds weights at most eta updates behind the update that step trains
on (`algorithm.max_staleness`), so no trained token is older than eta. With eta = 0 a step's prompts
enter only after the previous update: the synchronous step through the same engine.

Where the work runs: the generate call's placement (the plan's shadow generator on a disaggregated
plan, or the actor's home placement). The executor runs everything else of the step on a batch whose
generate outputs this module supplies (`Executor.collect` skips a node whose outputs are given), and
calls `overlap` while the train calls run: decode chunks on the generator's devices meanwhile. A re-plan
drains the stream before the weights move (`before_move`), and the stream goes on on the plan switched to.

Several processes (`run.distributed`): every process runs this loop and must issue the same programs
in the same order. Every host decision (admitted prompts, done groups, finished rows) is read from the
stream with `host_get`, alike on every process; every decision from timing (a reward worker's result
being in, the update still running) is agreed through the coordination service (`any_process_at`:
go on while it holds on any process). Each process scores the same rows with its own reward workers:
the rules are deterministic, so the scores are the same.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxrlhf.models import axes as ax
from jaxrlhf.models import slots as slot_sizes
from jaxrlhf.models import streaming
from jaxrlhf.models.lengths import bucket_length
from jaxrlhf.models.tokenizer import decode_responses
from jaxrlhf.models.transformer import positions_from_mask
from jaxrlhf.rewards.rules import CombinedReward
from jaxrlhf.rollouts import GENERATE_CALL, Rollout, RolloutStep
from jaxrlhf.transfer.host import host_get
from jaxrlhf.transfer.processes import any_process_at


@dataclasses.dataclass
class _Drawn:
    """One step's batch as drawn from the data: its feed, the data position after it, and its groups'
    progress (admitted so far; the outputs of the done ones, by prompt index)."""

    step: int
    feed: dict[str, Any]
    data_state: dict
    admitted: int = 0
    done: dict[int, tuple[dict[str, np.ndarray], np.ndarray]] = dataclasses.field(default_factory=dict)
    # row of the batch -> (the reward workers' future for the rows it was sent with, its place among them)
    scores: dict[int, tuple[Any, int]] = dataclasses.field(default_factory=dict)
    # dynamic sampling: row -> its rule components scored here (no workers); prompt index -> whether the
    # done group's shaped scores differ (informative), once its rows are scored
    parts: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    informative: dict[int, bool] = dataclasses.field(default_factory=dict)
    blocked_s: float = 0.0  # dynamic sampling: seconds the trainer waited for scores to decide on groups


class StreamingGenerator:
    """Streams the rollouts of steps `start + 1 .. stop` on the generate call's placement of `executor`.

    `draw(step)` returns the step's feed and data position (drawn in step order, each once). `batch(step)`
    returns the feed of `step` with the generate call's outputs in it, decoding until its groups are
    done; `overlap()` decodes while the trainer is busy; `updated()` after each step moves the
    generator to the new weights (the next chunk samples with them)."""

    def __init__(self, algorithm, executor, *, eta: int, start: int, stop: int,
                 draw: Callable[[int], dict[str, Any]]):
        cfg = algorithm.cfg
        self.executor, self.eta, self.stop, self.draw_step = executor, eta, stop, draw
        self.version = start  # trainer updates in the weights the generator holds
        self.next_step = start + 1  # the next step to draw
        self.prompts = cfg.data.batch_size  # groups trained per step
        self.group = algorithm.group_size
        self.prefix = algorithm.generated_prefix
        # dynamic sampling (`algorithm.dynamic_sampling`): a step's feed holds factor x B prompts; the
        # stream admits them in order, B at first, and one more for each group whose scores are all equal,
        # until B informative groups are done (or the feed runs out: then the batch is filled as the
        # synchronous step fills it). Admission pacing is unchanged, so eta still bounds staleness. The
        # filter is the synchronous step's own (`algorithm.group_filter`)
        self.dynamic = algorithm.dynamic_sampling
        self.pool_prompts = self.prompts * algorithm.pool_factor  # prompts in a step's feed
        self.algorithm = algorithm
        self.chunk = cfg.generation.stream_chunk
        self.graphdef = algorithm.models["actor"].graphdef
        self._place(executor)
        self.serials = 0  # groups admitted so far (the stream numbers them in the same order)
        self.steps: collections.OrderedDict[int, _Drawn] = collections.OrderedDict()  # drawn, not yet trained
        self.in_stream: dict[int, tuple[int, int]] = {}  # serial -> (step, prompt index) of a group in the stream
        self.busy_s = 0.0  # seconds decoding while the trainer trained (since the last `batch`)
        self.recompute = cfg.generation.partial_recompute  # rows in flight re-prefilled under new weights
        self.recompute_s = 0.0  # seconds recomputing KV (since the last `batch`)
        # rule rewards scored by worker processes as each sample ends (`rewards.workers`); the step's
        # `score_rules` host step is then skipped (its outputs come in the feed). A greedy baseline's
        # responses come from another call, scored in the step as before.
        self.pool = None if algorithm.greedy_baseline else algorithm.reward_pool
        self.scored: set[int] = set()  # stream rows (serial x G + j) handed to the workers, until taken
        self.reward_decode_s = 0.0  # seconds decoding the next steps while waiting for a batch's scores
        if self.pool is not None or self.dynamic:
            self.rules, self.tokenizer = CombinedReward(algorithm.rules_spec), algorithm.tokenizer
        if self.dynamic:
            self.filter = algorithm.group_filter

    def _place(self, executor) -> None:
        """Put an empty stream on `executor`'s generate placement (at the start, and after a re-plan's
        switch: `moved_to`)."""
        cfg, s, tok = self.algorithm.cfg, self.algorithm.settings(), self.algorithm.tokenizer
        self.executor = executor
        placed = executor.placed(GENERATE_CALL)
        with ax.activation_sharding(placed.resolver()):
            ways = ax.batch_ways()
        # Decode during training only on devices no train call of the actor uses (a disaggregated plan's
        # generator): elsewhere the chunks would compete with the update for the same devices, and on the
        # actor's home placement they would read the weights the update is donating.
        trained = executor.placed(executor.plan.home_call("actor"))
        self.overlaps = not ({d.id for d in placed.mesh.devices.flat} & {d.id for d in trained.mesh.devices.flat})
        # sized by the run's lead (`Config.generator_lead`, eta's bound), as the planner sizes it
        # (`Workload.engine_rows`): a pool wider than one batch decodes as many rows as the plan was priced with
        groups = slot_sizes.stream_groups(self.prompts, max(self.eta, cfg.generator_lead), ways)
        self.spec = streaming.StreamSpec.make(
            groups=groups, group_size=self.group, max_new_tokens=s.max_new_tokens,
            prompt_bucket=bucket_length(cfg.data.max_prompt_len, multiple=16),
            sampling=s.sampling, eos_id=() if s.ignore_eos else tok.eos_ids, pad_id=tok.pad_id,
            slots=s.slots or self.prompts * self.group,  # the synchronous engine's pool: the same memory
            kv_pages=s.kv_pages, batch_ways=ways)
        self._weights: tuple[int, Any] | None = None  # (version, a reallocated copy of the weights)
        # the stream's programs are traced with the generate placement's activation rules (`tag` keeps
        # their compiled programs apart from those of another placement)
        self.resolver, self.tag = placed.resolver(), (GENERATE_CALL, placed.placement)
        with ax.activation_sharding(self.resolver):
            self.state = streaming.init(self.graphdef, self._params(), spec=self.spec)
        self.free = groups  # group slots free in the stream

    def drain(self) -> dict[str, float]:
        """Decode until no admitted group is in flight, admitting nothing (a re-plan is about to move the
        weights to another plan, `Replanner.before_switch`): every group admitted so far finishes on the
        weights it started with and waits on host with the others; no sample is lost or restarted. The
        pause this costs, and the groups it finished, go to the metrics."""
        t0, groups = time.perf_counter(), self.spec.groups - self.free
        while self._decode_chunk():
            pass
        return {"replan/drain_s": time.perf_counter() - t0, "replan/drained_groups": float(groups)}

    def moved_to(self, executor) -> None:
        """Go on on `executor` (the plan a re-plan switched to) from a drained stream: a new, empty stream
        on its generate placement; the batches on host, their scores, the data position and the weight
        version carry over, and admission resumes where it stopped."""
        if self.free != self.spec.groups:
            raise RuntimeError("the stream must be drained before it moves to another plan")
        self._place(executor)
        self.serials = 0  # the new stream numbers its groups from 0 (none is in flight: `in_stream` is empty)

    def _params(self):
        """The actor's weights on the generator at `version`: its home copy or the plan's shadow as they
        are, or, where the plan reallocates them for generation, a copy made once per update and kept
        for every chunk until the next (the home copy is donated to the update meanwhile)."""
        if self._weights is not None and self._weights[0] == self.version:
            return self._weights[1]
        params, temporary = self.executor.params_for("actor", GENERATE_CALL)
        self._weights = (self.version, params) if temporary else None
        return params

    # ------------------------------------------------------------------ admission and decoding
    def _admissible(self, step: int) -> bool:
        """Whether `step`'s prompts may enter: trained after step - 1 updates, their first tokens from
        the generator's weights (`version` updates) must be at most eta behind."""
        return step - 1 - self.eta <= self.version

    def _admit_ready(self) -> None:
        """Admit waiting prompts, oldest step first, into free group slots while their step is admissible."""
        while self.free:
            pending = next((d for d in self.steps.values() if self._wanted(d)), None)
            if pending is None:
                if self.next_step > self.stop or not self._admissible(self.next_step):
                    return
                drawn = self.draw_step(self.next_step)
                pending = self.steps[self.next_step] = _Drawn(self.next_step, drawn["feed"], drawn["data_state"])
                self.next_step += 1
            if not self._admissible(pending.step):
                return
            self._admit_from(pending, min(self.free, self._wanted(pending)))

    def _wanted(self, drawn: _Drawn) -> int:
        """Prompts of the step to admit now: the rest of its batch, or, with dynamic sampling, one for
        each of its B groups not yet informative nor in flight (done but unscored counts as in flight)."""
        if not self.dynamic:
            return self.prompts - drawn.admitted
        self._classify(drawn)
        kept = sum(drawn.informative.values())
        open_ = drawn.admitted - len(drawn.informative)  # admitted, not yet decided
        return max(0, min(self.pool_prompts - drawn.admitted, self.prompts - kept - open_))

    def _complete(self, drawn: _Drawn) -> bool:
        """Every group of the batch done, or, with dynamic sampling, B informative groups done (then none
        is in flight) or the feed's prompts all decided."""
        if not self.dynamic:
            return len(drawn.done) == self.prompts
        self._classify(drawn)
        decided = len(drawn.informative) == drawn.admitted
        return decided and (sum(drawn.informative.values()) >= self.prompts or drawn.admitted == self.pool_prompts)

    def _progress(self, drawn: _Drawn | None) -> str:
        """Where the stream stands, for an error that should not happen: what the step admitted, finished and
        decided, and what the stream holds (a multi-process DAPO run with reward workers stopped once, in a
        loaded CI run, with its batch incomplete and nothing in flight; this says how the next one does)."""
        stream = (f"{self.spec.groups - self.free} of {self.spec.groups} group slots in flight, "
                  f"{len(self.in_stream)} groups in the stream's index, weights version {self.version}, "
                  f"next step to draw {self.next_step}")
        if drawn is None:
            return f"the step not drawn; {stream}"
        kept = sum(drawn.informative.values())
        return (f"admitted {drawn.admitted} of up to {self.pool_prompts} prompts for {self.prompts}, {len(drawn.done)} "
                f"done, {len(drawn.informative)} decided, {kept} informative; {stream}")

    def _group_parts(self, drawn: _Drawn, i: int) -> list[dict[str, float]] | None:
        """Prompt i's rows' rule components, or None while a worker still scores one."""
        rows = range(i * self.group, (i + 1) * self.group)
        if self.pool is None:
            return [drawn.parts[r] for r in rows]
        scored = all(r in drawn.scores and drawn.scores[r][0].done() for r in rows)
        if any_process_at("stream/unscored", not scored):  # workers' timing: agreed, scored on every process
            return None
        return [drawn.scores[r][0].result()[0][drawn.scores[r][1]] for r in rows]

    def _rule_scores(self, parts: list[dict[str, float]]) -> np.ndarray:
        return np.asarray([self.rules.combine(c) for c in parts], np.float32)

    def _classify(self, drawn: _Drawn) -> None:
        """Decide each done, scored group of the step: informative when its scores differ (`GroupFilter`)."""
        for i, (values, _) in drawn.done.items():
            if i not in drawn.informative:
                parts = self._group_parts(drawn, i)
                if parts is not None:
                    informative = self.filter.informative(self._rule_scores(parts), values["ended_with_eos"])
                    drawn.informative[i] = bool(informative[0])

    def _admit_from(self, drawn: _Drawn, k: int) -> None:
        B, G, first = self.pool_prompts, self.group, drawn.admitted
        feed = drawn.feed
        rows = np.arange(B) * G  # the first row of each group (`repeat_rows`: G adjacent copies)
        uids = np.where((np.arange(B) >= first) & (np.arange(B) < first + k), np.arange(B), -1).astype(np.int32)
        lengths = feed.get("max_lengths")
        lengths = (np.full((B, G), self.spec.max_new_tokens, np.int32) if lengths is None
                   else np.asarray(lengths, np.int32).reshape(B, G))
        with ax.activation_sharding(self.resolver):
            self.state, accepted = streaming.admit_fn(
                self.graphdef, self._params(), self.state, np.asarray(feed["prompt_tokens"])[rows],
                np.asarray(feed["prompt_mask"])[rows], uids, feed["rng_generate"], spec=self.spec,
                version=np.int32(self.version), max_lengths=lengths, tag=self.tag)
        accepted = np.asarray(host_get(accepted))
        if not np.array_equal(accepted, uids >= 0):  # the host's count of free slots is the stream's
            raise RuntimeError(f"stream admitted {accepted.sum()} of {k} prompts into {self.free} free slots")
        self.in_stream.update({self.serials + j: (drawn.step, first + j) for j in range(k)})
        self.serials += k
        drawn.admitted += k
        self.free -= k

    def _decode_chunk(self) -> bool:
        """One chunk of decode steps, then the done groups taken; False when nothing was left to decode."""
        if self.free == self.spec.groups:
            return False
        with ax.activation_sharding(self.resolver):
            self.state = streaming.run_fn(self.graphdef, self._params(), self.state, spec=self.spec,
                                          version=np.int32(self.version), max_steps=np.int32(self.chunk),
                                          until_done_groups=np.int32(self.spec.groups + 1), tag=self.tag)
            if self.pool is not None:
                self._score_finished()
            taken, self.state = streaming.take(self.state, spec=self.spec, tag=self.tag, read=host_get)
        out = taken.output
        G = self.group
        for k, serial in enumerate(taken.serials):
            step, i = self.in_stream.pop(int(serial))
            rows = slice(k * G, (k + 1) * G)
            values = {"tokens": out.tokens[rows], "prompt_mask": out.prompt_mask[rows],
                      "response_tokens": out.response_tokens[rows], "response_mask": out.response_mask[rows],
                      "behaviour_logp": out.logprobs[rows], "ended_with_eos": out.ended_with_eos[rows]}
            self.steps[step].done[i] = (values, taken.versions[rows])
            if self.dynamic and self.pool is None:  # scored here: the group decides what is admitted next
                self._score_here(self.steps[step], i, values)
            self.scored.difference_update(int(serial) * G + j for j in range(G))
        self.free += len(taken.serials)
        return True

    def _score_here(self, drawn: _Drawn, i: int, values: dict[str, np.ndarray]) -> None:
        rows = range(i * self.group, (i + 1) * self.group)
        texts = decode_responses(self.tokenizer, values["response_tokens"], values["response_mask"])
        parts = self.rules.batch_components([drawn.feed["prompts"][r] for r in rows], texts,
                                            [drawn.feed["answers"][r] for r in rows])
        drawn.parts.update(zip(rows, parts))

    def _score_finished(self) -> None:
        """Hand every sample that ended since the last look to the reward workers, whether or not its
        group is done (a group ends with its slowest sample; its advantages still wait for the whole
        batch, in the step). Each step's new samples go as up to `workers` tasks (a rule that scores rows
        concurrently, as `remote` does, keeps that concurrency), queued by step: the oldest first."""
        done, serials = host_get(streaming.finished_rows_fn(self.state, spec=self.spec, tag=self.tag))
        G = self.group
        fresh: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # step -> (stream row, batch row)
        for r in np.flatnonzero(done):
            serial = int(serials[r // G])
            if serial * G + r % G in self.scored:
                continue
            self.scored.add(serial * G + r % G)
            step, i = self.in_stream[serial]
            fresh[step].append((int(r), i * G + r % G))
        if not fresh:
            return
        stream_rows = [r for picked in fresh.values() for r, _ in picked]
        width = 1 << (len(stream_rows) - 1).bit_length()  # a power of two: few gather programs
        tokens, valid = host_get(streaming.response_rows_fn(
            self.state, np.asarray(stream_rows + [0] * (width - len(stream_rows)), np.int32), spec=self.spec,
            tag=self.tag))
        at = {r: k for k, r in enumerate(stream_rows)}
        for step, picked in fresh.items():
            drawn = self.steps[step]
            texts = decode_responses(self.tokenizer, tokens[[at[r] for r, _ in picked]],
                                     valid[[at[r] for r, _ in picked]])
            size = -(-len(picked) // self.pool.workers)
            for start in range(0, len(picked), size):
                batch_rows = [b for _, b in picked[start:start + size]]
                future = self.pool.submit([drawn.feed["prompts"][b] for b in batch_rows], texts[start:start + size],
                                          [drawn.feed["answers"][b] for b in batch_rows], priority=step)
                drawn.scores.update({b: (future, k) for k, b in enumerate(batch_rows)})

    def _rewards(self, drawn: _Drawn) -> tuple[dict[str, Any], dict[str, float]]:
        """The step's rule scores and components from the workers (what `score_rules` returns), and how
        much of their time was hidden: 1 - (the trainer's idle wait for them after the batch was done) /
        (their seconds spread over the workers). While it waits, the stream decodes the next steps'
        samples where they may be (admission pacing as ever): that time is the next batches' work, not
        idling (`time/reward_decode_s`)."""
        futures = {id(f): f for f, _ in drawn.scores.values()}
        t0, decoding = time.perf_counter(), 0.0
        while any_process_at("stream/rewards", not all(f.done() for f in futures.values())):
            self._admit_ready()
            t1 = time.perf_counter()
            if not self._decode_chunk():
                concurrent.futures.wait(futures.values())
                break
            decoding += time.perf_counter() - t1
        waited = time.perf_counter() - t0 - decoding
        parts = [drawn.scores[b][0].result()[0][drawn.scores[b][1]] for b in range(self.prompts * self.group)]
        work = sum(f.result()[1] for f in futures.values()) / self.pool.workers
        values = {"rule_scores": np.asarray([self.rules.combine(c) for c in parts], np.float32),
                  "rule_components": {n: np.asarray([c[n] for c in parts], np.float32) for n in self.rules.names}}
        return values, {"time/reward_wait_s": waited, "time/reward_work_s": work, "time/reward_decode_s": decoding,
                        "reward/hidden_frac": max(0.0, 1.0 - waited / work) if work > 0 else 1.0}

    # ------------------------------------------------------------------ the trainer's side
    def batch(self, step: int) -> tuple[dict[str, Any], dict, dict[str, float]]:
        """The feed of `step` with its generated batch (the generate call's outputs), the data position
        after it, and its rollout metrics; decodes until every group of the step is done."""
        t0 = time.perf_counter()
        if step != next(iter(self.steps), self.next_step):
            raise RuntimeError(f"batches are trained in order: asked for step {step}")
        while True:
            self._admit_ready()
            drawn = self.steps.get(step)
            if drawn is not None and self._complete(drawn):
                break
            if self._decode_chunk():
                continue
            # Nothing in flight. Scores that came in since this pass looked may have decided groups: the
            # batch is then complete, or its step wants another prompt (admitted on the next pass). Each of
            # the two checks decides what scores are in by then, so a group decided by the second (another
            # process's workers finishing between them) can complete a batch the first found short: any
            # group decided here sends the loop round again, to look at the batch as it now stands.
            if drawn is not None and self.dynamic:
                decided = len(drawn.informative)
                if self._complete(drawn) or self._wanted(drawn) > 0 or len(drawn.informative) != decided:
                    continue
            scoring = [] if drawn is None else [f for f, _ in drawn.scores.values() if not f.done()]
            # A group whose scores came in after it was last classified (unscored then) is decided on the
            # next pass: no reason to stop either. Both flags are read alike on every process.
            undecided = drawn is not None and any(i not in drawn.informative for i in drawn.done)
            if not (self.dynamic and any_process_at("stream/scoring", bool(scoring) or undecided)):
                raise RuntimeError(f"step {step}: nothing left to decode, but its batch is not complete "
                                   f"({self._progress(drawn)})")
            t1 = time.perf_counter()  # dynamic sampling: the next admissions wait for these scores
            concurrent.futures.wait(scoring, return_when=concurrent.futures.FIRST_COMPLETED)
            drawn.blocked_s += time.perf_counter() - t1
        del self.steps[step]
        waited = time.perf_counter() - t0 - drawn.blocked_s
        feed = dict(drawn.feed)
        order = sorted(drawn.done)  # the generated groups, in the feed's order
        groups = [drawn.done[i] for i in order]
        values = {k: np.concatenate([g[0][k] for g in groups]) for k in groups[0][0]}
        versions = np.concatenate([g[1] for g in groups])
        prompt_mask = values.pop("prompt_mask")
        mask = np.concatenate([prompt_mask, values["response_mask"]], axis=1)
        values.update(mask=mask, positions=np.asarray(positions_from_mask(mask)))  # the training forward's rule
        if self.dynamic:
            feed, values, versions = self._selected(drawn, order, values, versions)
        else:
            feed.update({self.prefix + k: v for k, v in values.items()})
        metrics = self._metrics(step, versions, values["response_mask"])
        metrics.update({"time/generate_wait_s": waited, "time/generate_overlap_s": self.busy_s})
        if self.recompute:  # the trainer waited for it too (after the last update)
            metrics["time/kv_recompute_s"] = self.recompute_s
            metrics["time/generate_wait_s"] += self.recompute_s
            self.recompute_s = 0.0
        if self.pool is not None and self.dynamic:  # every score is in: the groups were decided on them
            futures = {id(f): f for f, _ in drawn.scores.values()}
            work = sum(f.result()[1] for f in futures.values()) / self.pool.workers
            metrics.update({"time/reward_wait_s": drawn.blocked_s, "time/reward_work_s": work,
                            "reward/hidden_frac": max(0.0, 1.0 - drawn.blocked_s / work) if work > 0 else 1.0})
        elif self.pool is not None:
            rewards, timing = self._rewards(drawn)
            feed.update(rewards)
            metrics.update(timing)
            metrics["time/generate_wait_s"] += timing["time/reward_decode_s"]  # the trainer's time in the stream
        self.busy_s = 0.0
        return feed, drawn.data_state, metrics

    def _selected(self, drawn: _Drawn, order: list[int], values: dict[str, np.ndarray], versions: np.ndarray
                  ) -> tuple[dict[str, Any], dict[str, np.ndarray], np.ndarray]:
        """Dynamic sampling: the step's batch chosen from its generated groups by the synchronous step's filter
        (`GroupFilter.select`: informative groups first, in the feed's order, as from its whole pool), in
        the feed as the outputs of the generate call, `score_rules` and `select_groups` (all three
        skipped in the step), with the feed's prompt rows cut to the chosen ones."""
        G, feed = self.group, dict(drawn.feed)
        rows = np.asarray([i * G + j for i in order for j in range(G)])
        parts = [c for i in order for c in self._group_parts(drawn, i)]
        rules = {"rule_scores": self._rule_scores(parts),
                 "rule_components": {n: np.asarray([c[n] for c in parts], np.float32) for n in self.rules.names}}
        rowwise = [k for k in ("prompts", "answers", "prompt_tokens", "prompt_mask", "max_lengths") if k in feed]
        pool = {**values, **rules, "versions": versions, **{k: np.asarray(feed[k])[rows] for k in rowwise}}
        out, stats = self.filter.select(pool, rules["rule_scores"])
        for k in rowwise:
            feed[k] = out.pop(k).tolist() if isinstance(feed[k], (list, tuple)) else out.pop(k)
        versions = out.pop("versions")
        chosen = {k: out[k] for k in values}
        generated = {self.prefix + k: v for k, v in chosen.items()}  # the generate call's outputs (`pool_`)
        generated.update({self.algorithm.uncut_prefix + k: v for k, v in chosen.items()})  # select_groups'
        feed.update(generated, rule_scores=out["rule_scores"], rule_components=out["rule_components"],
                    pool_rule_scores=out["rule_scores"], pool_rule_components=out["rule_components"],
                    sampling_stats={k: np.float32(v) for k, v in stats.items()})
        return feed, chosen, versions

    def _metrics(self, step: int, versions: np.ndarray, response_mask: np.ndarray) -> dict[str, float]:
        """Staleness of the batch's tokens: trainer updates (step - 1) minus the version that sampled each."""
        valid = response_mask.astype(bool) & (versions >= 0)
        lag = (step - 1) - versions[valid]
        if lag.size and lag.max() > self.eta:  # admission pacing guarantees it; a breach is a bug
            raise RuntimeError(f"step {step}: a token {lag.max()} updates old was about to be trained "
                               f"(algorithm.max_staleness={self.eta})")
        spans = [len(set(v[m].tolist())) for v, m in zip(versions, valid)]
        out = {"rollout/staleness": float(lag.max(initial=0)), "rollout/staleness_mean": float(lag.mean()) if lag.size else 0.0,
               "rollout/policy_version": float(versions[valid].min(initial=step - 1)),
               "rollout/partial_frac": float(np.mean([n > 1 for n in spans]))}
        for k in range(self.eta + 1):
            out[f"rollout/staleness_frac/{k}"] = float(np.mean(lag == k)) if lag.size else 0.0
        return out

    def overlap(self) -> None:
        """Decode while the trainer's update runs on its own devices (the executor calls this once the
        train calls are dispatched): chunk after chunk until the update is done or nothing is left."""
        if not self.overlaps:
            return
        t0 = time.perf_counter()
        actor = self.executor.roles["actor"]
        leaves = [x for x in jax.tree_util.tree_leaves(actor.params) if isinstance(x, jax.Array)]
        # decode while any process's shards of the update are not done: a timing, so agreed by all processes
        while any_process_at("stream/overlap", not all(x.is_ready() for x in leaves)):
            self._admit_ready()
            if not self._decode_chunk():
                break
        self.busy_s += time.perf_counter() - t0

    def updated(self) -> None:
        """The trainer finished an update and synced it: the next chunk samples with the new weights,
        over the old weights' KV cache, or (`generation.partial_recompute`) over a cache recomputed
        with them (every admitted prompt and every decoding row's tokens so far)."""
        self.version += 1
        if self.recompute and self.free < self.spec.groups:
            t0 = time.perf_counter()
            with ax.activation_sharding(self.resolver):
                self.state = streaming.recompute_fn(self.graphdef, self._params(), self.state, spec=self.spec,
                                                    version=np.int32(self.version), tag=self.tag)
            jax.block_until_ready(self.state.pool)
            self.recompute_s += time.perf_counter() - t0


class StreamRollout(Rollout):
    """Partial rollouts: each step's batch from a `StreamingGenerator` on the generate call's placement, which
    decodes on while the step trains (`overlap`) and takes the new weights after it (`trained`)."""

    name = "stream"

    def begin(self, executor, *, draw, start, stop, staleness=0):
        super().begin(executor, draw=draw, start=start, stop=stop, staleness=staleness)
        self.generator = StreamingGenerator(self.algorithm, executor, eta=staleness, start=start, stop=stop, draw=draw)

    def step(self, step: int) -> RolloutStep:
        feed, data_state, metrics = self.generator.batch(step)
        # the trainer waited for the stream first, and for the reward workers' last groups
        seconds = metrics["time/generate_wait_s"] + metrics.get("time/reward_wait_s", 0.0)
        return RolloutStep(feed, data_state, metrics=metrics, seconds=seconds, overlap=self.generator.overlap)

    def trained(self) -> None:
        self.generator.updated()

    def before_move(self) -> dict[str, float]:
        return self.generator.drain()

    def moved_to(self, executor) -> None:
        super().moved_to(executor)
        self.generator.moved_to(executor)

