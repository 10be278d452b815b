"""The megakernel's executable specification: a jax.numpy interpreter of the task list.

It executes a Schedule task by task, in order, with the kernel's arithmetic (float32 accumulation,
the RMSNorm factor over the whole input, RoPE in float32, exp2-domain attention splits combined by
their log2-sum-exp2) and the kernel's rounding points (q, the cache entries, the attention output,
the residual stream and the gated activations are stored in the activation dtype). Counters are
tracked as the kernel tracks them: a task whose input counter has not reached its target when its
turn comes is a ScheduleError, and the combine and the token pick happen when the last task of
their group arrives.

`per_task=False` (the default, and the reference path of `decode_step`) executes each run of
consecutive tasks of one kind and layer as one batched operation: they are independent by
construction, and the tests check both modes agree.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lithos.custom_calls.dispatch import cache_slots
from lithos.custom_calls.megakernel.schedule import Schedule, ScheduleError, describe_task
from lithos.custom_calls.megakernel.tasks import NO_COUNTER, ROWS_PER_UNIT, Op, QkvRows, Task
from lithos.custom_calls.numerics import f32, project, rms_normalize
from lithos.custom_calls.packed_weights import pick, values_f32
from lithos.kv_cache import slot_positions

MIN_KEYS_PER_SPLIT = 64  # csrc/mk_attention.h kMinKeysPerSplit
LOG2E = 1.4426950408889634


class StepWeights(NamedTuple):
    """A Llama-family decoder's weights as the megakernel reads them, stacked by layer. The matrices
    are bf16 arrays or lithos.quant packed arrays; the norms are bf16."""

    attn_norm: jax.Array  # [layers, hidden]
    wq: jax.Array  # [layers, heads * head_dim, hidden]
    wk: jax.Array  # [layers, kv_heads * head_dim, hidden]
    wv: jax.Array
    wo: jax.Array  # [layers, hidden, heads * head_dim]
    mlp_norm: jax.Array  # [layers, hidden]
    w_gate: jax.Array  # [layers, ffn, hidden]
    w_up: jax.Array
    w_down: jax.Array  # [layers, hidden, ffn]
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array  # [vocab, hidden]


class StepOutputs(NamedTuple):
    k_cache: jax.Array  # [layers, 1, kv_heads, slots, head_dim]
    v_cache: jax.Array
    h: jax.Array  # [tokens, hidden]: the last layer's output, before the final norm
    tokens: jax.Array | None  # [tokens] int32 greedy tokens (schedules with a head)
    logits: jax.Array | None  # [tokens, vocab] float32 (when asked for)


class SplitPlan(NamedTuple):
    begin: jax.Array
    split_len: jax.Array
    end: jax.Array
    splits: jax.Array


def plan_splits(positions: jax.Array, slots: int, window: int, ring: bool, max_splits: int) -> SplitPlan:
    """The key positions the step's queries see and their cut into splits (csrc/mk_attention.h plan_splits)."""
    end = jnp.max(positions) + 1 if ring else jnp.minimum(jnp.max(positions) + 1, slots)
    begin = jnp.maximum(0, jnp.min(positions) - window + 1) if window > 0 else jnp.zeros((), jnp.int32)
    if ring:  # a ring holds the newest `slots` positions
        begin = jnp.maximum(begin, end - slots)
    keys = jnp.maximum(end - begin, 0)
    splits = jnp.maximum(1, jnp.minimum(max_splits, (keys + MIN_KEYS_PER_SPLIT - 1) // MIN_KEYS_PER_SPLIT))
    return SplitPlan(begin, (keys + splits - 1) // splits, end, splits)


def _exp2_weights(lse: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """exp2(lse - max) along `axis` with -inf entries weighing 0, and whether any entry is finite."""
    best = jnp.max(lse, axis=axis, keepdims=True)
    seen = jnp.isfinite(best)
    weights = jnp.where(jnp.isfinite(lse), jnp.exp2(lse - jnp.where(seen, best, 0.0)), 0.0)
    return weights, seen


class _Step:
    """The buffers of one step (as the kernel's global memory) and the task kinds acting on them."""

    def __init__(
        self,
        schedule: Schedule,
        w: StepWeights,
        h0,
        positions,
        inv_freq,
        k_cache,
        v_cache,
        eps,
        window,
        ring,
        with_logits,
    ):
        s = self.shape = schedule.shape
        self.schedule, self.w, self.eps, self.window, self.ring = schedule, w, eps, int(window or 0), ring
        self.h0, self.positions, self.inv_freq = h0, positions.astype(jnp.int32), f32(inv_freq)
        self.k_cache, self.v_cache = k_cache, v_cache
        T, act = h0.shape[0], h0.dtype
        self.tokens, self.act, self.slots = T, act, k_cache.shape[3]
        self.residual = [jnp.zeros((T, s.hidden), act), jnp.zeros((T, s.hidden), act)]  # after attention, after MLP
        self.q = jnp.zeros((T, s.heads * s.head_dim), act)
        self.attn = jnp.zeros((T, s.heads * s.head_dim), act)
        self.gated = jnp.zeros((T, s.ffn), act)
        rows = T * s.group
        self.part_out = jnp.zeros((s.kv_heads, schedule.max_splits, rows, s.head_dim), jnp.float32)
        self.part_lse = jnp.full((s.kv_heads, schedule.max_splits, rows), -jnp.inf, jnp.float32)
        self.best_value = jnp.full((max(schedule.head_tasks, 1), T), -jnp.inf, jnp.float32)
        self.best_index = jnp.zeros((max(schedule.head_tasks, 1), T), jnp.int32)
        self.logits = jnp.zeros((T, s.vocab), jnp.float32) if with_logits else None
        self.tokens_out = None
        self.plan = plan_splits(self.positions, self.slots, self.window, ring, schedule.max_splits)

    def matrix(self, name: str, layer: int | None = None) -> jax.Array:
        """Weight `name` (of `layer`) as exact float32 values: what the kernel's dot products read."""
        w = getattr(self.w, name)
        return values_f32(w if layer is None else pick(w, layer))

    def layer_input(self, layer: int) -> jax.Array:
        return self.h0 if layer == 0 else self.residual[1]

    # -- task kinds ------------------------------------------------------------------------------

    def qkv(self, layer: int, units: np.ndarray) -> None:
        s, w = self.shape, self.w
        x = rms_normalize(self.layer_input(layer), w.attn_norm[layer], self.eps)
        where = QkvRows.of(s, units)
        rows = where.rows(s)  # [n, 4]
        matrix = jnp.concatenate([self.matrix(name, layer) for name in ("wq", "wk", "wv")], axis=0)
        values = project(x, matrix[rows.reshape(-1)]).reshape(self.tokens, len(units), 2, 2)  # [T, n, pair, lo/hi]
        lo, hi = values[..., 0], values[..., 1]
        j = where.first_pair[:, None] + np.arange(2)[None, :]  # [n, 2]
        angle = self.positions[:, None, None].astype(jnp.float32) * self.inv_freq[j][None]  # [T, n, 2]
        cos, sin = jnp.cos(angle), jnp.sin(angle)
        rotate = (where.slot != s.group + 1)[None, :, None]
        lo, hi = jnp.where(rotate, lo * cos - hi * sin, lo), jnp.where(rotate, hi * cos + lo * sin, hi)
        half = s.head_dim // 2
        dims = np.concatenate([j, j + half], axis=1)  # [n, 4]: the head dims the values land in
        values = jnp.concatenate([lo, hi], axis=2)  # [T, n, 4] in the order of `dims`

        is_q = where.slot < s.group
        if is_q.any():
            head = where.kv_head[is_q] * s.group + where.slot[is_q]
            columns = (head[:, None] * s.head_dim + dims[is_q]).reshape(-1)
            self.q = self.q.at[:, columns].set(values[:, is_q].reshape(self.tokens, -1).astype(self.act))
        slots = cache_slots(self.positions, self.slots, self.ring)
        for cache_name, slot in (("k_cache", s.group), ("v_cache", s.group + 1)):
            mine = where.slot == slot
            if not mine.any():
                continue
            kv = np.broadcast_to(where.kv_head[mine][:, None], dims[mine].shape).reshape(-1)
            d = dims[mine].reshape(-1)
            cache = getattr(self, cache_name)
            update = values[:, mine].reshape(self.tokens, -1).astype(cache.dtype)  # [T, n*4]
            cache = cache.at[layer, 0, kv[None, :], slots[:, None], d[None, :]].set(update, mode="drop")
            setattr(self, cache_name, cache)

    def attention_splits(self, layer: int, kv_heads: np.ndarray, splits: np.ndarray) -> None:
        """Partial outputs of splits (kv_heads[i], splits[i]); splits past the plan's count write nothing."""
        s, plan = self.shape, self.plan
        T, G, d = self.tokens, s.group, s.head_dim
        q = f32(self.q).reshape(T, s.kv_heads, G, d)[:, kv_heads]  # [T, n, G, d]
        keys = f32(self.k_cache[layer, 0, kv_heads])  # [n, S, d]
        values = f32(self.v_cache[layer, 0, kv_heads])
        scale_log2 = LOG2E / math.sqrt(d)
        scores = jnp.einsum("tngd,nsd->ntgs", q * jnp.float32(scale_log2), keys, precision=jax.lax.Precision.HIGHEST)
        # The key position each slot holds; a ring's newest is the step's last query, stored by now.
        key = slot_positions(jnp.max(self.positions), self.slots) if self.ring else jnp.arange(self.slots)
        first = plan.begin + jnp.asarray(splits) * plan.split_len  # [n]
        last = jnp.minimum(first + plan.split_len, plan.end)
        in_split = (key[None, :] >= first[:, None]) & (key[None, :] < last[:, None])  # [n, S]
        visible = key[None, :] <= self.positions[:, None]  # [T, S]
        if self.window > 0:
            visible &= key[None, :] > self.positions[:, None] - self.window
        mask = in_split[:, None, None, :] & visible[None, :, None, :]  # [n, T, 1, S]
        scores = jnp.where(mask, scores, -jnp.inf)
        best = jnp.max(scores, axis=-1, keepdims=True)
        seen = jnp.isfinite(best)
        p = jnp.where(mask, jnp.exp2(scores - jnp.where(seen, best, 0.0)), 0.0)
        total = jnp.sum(p, axis=-1)  # [n, T, G]
        out = jnp.einsum("ntgs,nsd->ntgd", p, values, precision=jax.lax.Precision.HIGHEST)
        out = jnp.where((total > 0)[..., None], out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
        lse = jnp.where(total > 0, best[..., 0] + jnp.log2(jnp.where(total > 0, total, 1.0)), -jnp.inf)
        active = jnp.asarray(splits) < plan.splits  # [n]
        rows = T * G
        old_out, old_lse = self.part_out[kv_heads, splits], self.part_lse[kv_heads, splits]
        new_out = jnp.where(active[:, None, None], out.reshape(-1, rows, d), old_out)
        new_lse = jnp.where(active[:, None], lse.reshape(-1, rows), old_lse)
        self.part_out = self.part_out.at[kv_heads, splits].set(new_out)
        self.part_lse = self.part_lse.at[kv_heads, splits].set(new_lse)

    def attention_combine(self, kv_heads: np.ndarray) -> None:
        s = self.shape
        T, G, d = self.tokens, s.group, s.head_dim
        in_use = jnp.arange(self.schedule.max_splits) < self.plan.splits  # [S]
        lse = jnp.where(in_use[None, :, None], self.part_lse[kv_heads], -jnp.inf)  # [n, S, rows]
        weights, seen = _exp2_weights(lse, axis=1)
        total = jnp.sum(weights, axis=1)  # [n, rows]
        out = jnp.einsum("nsr,nsrd->nrd", weights, self.part_out[kv_heads], precision=jax.lax.Precision.HIGHEST)
        out = jnp.where((seen[:, 0] & (total > 0))[..., None], out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
        # rows are (token, head of the group): the group's heads of [tokens, heads * head_dim]
        heads = kv_heads[:, None] * G + np.arange(G)[None, :]  # [n, G]
        columns = (heads[:, :, None] * d + np.arange(d)).reshape(-1)
        values = out.reshape(len(kv_heads), T, G, d).transpose(1, 0, 2, 3).reshape(T, -1)
        self.attn = self.attn.at[:, columns].set(values.astype(self.act))

    def projection(self, op: Op, layer: int, units: np.ndarray) -> None:
        s = self.shape
        rows = (units[:, None] * ROWS_PER_UNIT + np.arange(ROWS_PER_UNIT)).reshape(-1)
        rows = rows[rows < s.hidden]
        if op == Op.O_PROJ:
            x, matrix, residual = self.attn, self.matrix("wo", layer), self.layer_input(layer)
        else:
            x, matrix, residual = self.gated, self.matrix("w_down", layer), self.residual[0]
        y = project(x, matrix[rows]) + f32(residual[:, rows])
        slot = 0 if op == Op.O_PROJ else 1
        self.residual[slot] = self.residual[slot].at[:, rows].set(y.astype(self.act))

    def gate_up(self, layer: int, units: np.ndarray) -> None:
        s, w = self.shape, self.w
        outs = (units[:, None] * 2 + np.arange(2)).reshape(-1)
        outs = outs[outs < s.ffn]
        x = rms_normalize(self.residual[0], w.mlp_norm[layer], self.eps)
        gate, up = project(x, self.matrix("w_gate", layer)[outs]), project(x, self.matrix("w_up", layer)[outs])
        self.gated = self.gated.at[:, outs].set((jax.nn.silu(gate) * up).astype(self.act))

    def head(self, tasks: list[Task]) -> None:
        """Logits of each task's rows and each task's best (value, lowest id) per token."""
        s = self.shape
        x = rms_normalize(self.residual[1], self.w.final_norm, self.eps)
        head = self.matrix("lm_head")
        for task in tasks:
            rows = np.arange(task.first * ROWS_PER_UNIT, min((task.first + task.count) * ROWS_PER_UNIT, s.vocab))
            logits = project(x, head[rows[0] : rows[-1] + 1])  # [T, rows]
            if self.logits is not None:
                self.logits = self.logits.at[:, rows[0] : rows[-1] + 1].set(logits)
            self.best_value = self.best_value.at[task.aux].set(jnp.max(logits, axis=-1))
            self.best_index = self.best_index.at[task.aux].set(rows[0] + jnp.argmax(logits, axis=-1).astype(jnp.int32))

    def pick_tokens(self) -> None:
        values, ids = self.best_value[: self.schedule.head_tasks], self.best_index[: self.schedule.head_tasks]
        best = jnp.max(values, axis=0, keepdims=True)
        self.tokens_out = jnp.min(jnp.where(values == best, ids, jnp.iinfo(jnp.int32).max), axis=0)


def _runs(tasks: list[Task], per_task: bool) -> list[list[Task]]:
    """Maximal runs of consecutive tasks of one kind and layer (single tasks when per_task)."""
    runs: list[list[Task]] = []
    for task in tasks:
        if runs and not per_task and (runs[-1][0].op, runs[-1][0].layer) == (task.op, task.layer):
            runs[-1].append(task)
        else:
            runs.append([task])
    return runs


def _units(run: list[Task]) -> np.ndarray:
    return np.concatenate([np.arange(t.first, t.first + t.count) for t in run])


def interpret(
    schedule: Schedule,
    weights: StepWeights,
    h0: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    eps: float,
    window: int | None = None,
    ring: bool = False,
    with_logits: bool = False,
    per_task: bool = False,
) -> StepOutputs:
    """Run `schedule` on h0 `[tokens, hidden]` (the embedded tokens) at `positions` `[tokens]`, with
    the caches `[layers, 1, kv_heads, slots, head_dim]` (a ring with `ring`: slot = position % slots);
    returns what the kernel returns."""
    step = _Step(schedule, weights, h0, positions, inv_freq, k_cache, v_cache, eps, window, ring, with_logits)
    counters = np.zeros(schedule.n_counters, np.int64)
    index = 0
    for run in _runs([schedule.task(i) for i in range(len(schedule))], per_task):
        for offset, task in enumerate(run):
            if task.wait_counter != NO_COUNTER and counters[task.wait_counter] < task.wait_target:
                raise ScheduleError(
                    f"{describe_task(schedule, index + offset)} runs before its input is complete "
                    f"({counters[task.wait_counter]} of {task.wait_target} signals)"
                )
        op, layer = run[0].op, run[0].layer
        if op == Op.QKV:
            step.qkv(layer, _units(run))
        elif op == Op.ATTENTION:
            step.attention_splits(layer, np.array([t.first for t in run]), np.array([t.count for t in run]))
        elif op in (Op.O_PROJ, Op.DOWN):
            step.projection(op, layer, _units(run))
        elif op == Op.GATE_UP:
            step.gate_up(layer, _units(run))
        elif op == Op.HEAD:
            step.head(run)
        completed = []
        for task in run:
            counters[task.signal_counter] += 1
            if task.arrivals and counters[task.signal_counter] == task.arrivals:
                completed.append(task)
        if op == Op.ATTENTION and completed:
            step.attention_combine(np.array([t.first for t in completed]))
            for task in completed:
                counters[task.aux] += 1
        if op == Op.HEAD and completed:
            step.pick_tokens()
        index += len(run)
    return StepOutputs(step.k_cache, step.v_cache, step.residual[1], step.tokens_out, step.logits)
