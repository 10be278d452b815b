// What the two split-attention kernels share (flash-decoding: attention.cu, and the megakernel's
// mk_attention.h): the split plan taken from the positions on the device, a key position's slot in a
// linear or ring cache, one query row's online-softmax state in the exp2 domain, a loop step's scores
// folded into it, and the fold of a warp's lane groups.
#pragma once

#include <climits>
#include <cstdint>

#include "portable.h"

namespace lithos {

struct SplitPlan {
  int begin;      // first key any query sees
  int split_len;  // keys per split
  int end;        // one past the last key any query sees
  int splits;     // splits in use (<= max_splits)
  int lap;        // the position held by slot 0 in the ring's lap where `begin` lies (0 when linear)
  int fresh;      // the lowest position this step appends: keys from here on are this step's

  // Split s's keys, [split_begin(s), split_end(s)).
  __device__ __forceinline__ int split_begin(int s) const { return begin + s * split_len; }
  __device__ __forceinline__ int split_end(int s) const { return min(split_begin(s) + split_len, end); }
};

// The keys the step's `tokens` queries see, cut into at most `max_splits` splits of at least
// `min_split_keys` keys: a 1K context inside a 1M cache reads 1K keys.
__device__ inline SplitPlan plan_splits(const int32_t* positions, int tokens, int slots, int window, bool ring,
                                        int max_splits, int min_split_keys) {
  int lowest = INT_MAX, highest = -1;
  for (int t = 0; t < tokens; ++t) {
    lowest = min(lowest, positions[t]);
    highest = max(highest, positions[t]);
  }
  SplitPlan plan;
  plan.fresh = lowest;
  plan.end = ring ? highest + 1 : min(highest + 1, slots);
  plan.begin = window > 0 ? max(0, lowest - window + 1) : 0;
  // A ring holds the newest `slots` positions; the handlers checked that every window lies within them.
  if (ring) plan.begin = max(plan.begin, plan.end - slots);
  plan.lap = ring ? plan.begin - plan.begin % slots : 0;
  const int keys = max(plan.end - plan.begin, 0);
  plan.splits = max(1, min(max_splits, (keys + min_split_keys - 1) / min_split_keys));
  plan.split_len = (keys + plan.splits - 1) / plan.splits;
  return plan;
}

// The slot of key position `key` in [plan.begin, plan.end), which spans at most one lap of a ring.
__device__ __forceinline__ int slot_of(const SplitPlan& plan, int slots, int key) {
  const int slot = key - plan.lap;
  return slot < slots ? slot : slot - slots;
}

// Online-softmax state of one query row over the keys seen so far (exp2 domain).
struct Softmax {
  float max;
  float sum;
  float acc[8];  // this lane's 8 output dimensions, unnormalised
};

// Fold `other` (the same row's state over other keys) into `s`.
__device__ __forceinline__ void merge(Softmax& s, float other_max, float other_sum, const float (&other_acc)[8]) {
  const float new_max = fmaxf(s.max, other_max);
  if (new_max == -INFINITY) return;  // neither has seen a visible key
  const float mine = exp2f(s.max - new_max), theirs = exp2f(other_max - new_max);
  s.sum = s.sum * mine + other_sum * theirs;
#pragma unroll
  for (int e = 0; e < 8; ++e) s.acc[e] = s.acc[e] * mine + other_acc[e] * theirs;
  s.max = new_max;
}

// One loop step of a split over ROWS query rows: each of the KEYS keys (key[u], with this lane's 8
// elements of its K and V rows in k[u] and v[u], LANES lanes per key) is scored against every row
// that sees it (see_from..see_to, and before key_end), and the visible ones are folded into the row's
// state. `score_fold` and `value_fold` undo scales taken out of the cache's codes (FP8); 1 for bf16.
template <int ROWS, int KEYS, int LANES, class Vec>
__device__ __forceinline__ void score_keys(const float (&q)[ROWS][8], const int (&key)[KEYS], const Vec (&k)[KEYS],
                                           const Vec (&v)[KEYS], int key_end, const int (&see_from)[ROWS],
                                           const int (&see_to)[ROWS], float score_fold, float value_fold,
                                           Softmax (&state)[ROWS]) {
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    float score[KEYS];
    float step_max = -INFINITY;
#pragma unroll
    for (int u = 0; u < KEYS; ++u) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) dot = fmaf(q[j][e], k[u][e], dot);
      dot = group_sum<LANES>(dot) * score_fold;
      const bool visible = key[u] < key_end && key[u] <= see_to[j] && key[u] >= see_from[j];
      score[u] = visible ? dot : -INFINITY;
      step_max = fmaxf(step_max, score[u]);
    }
    if (step_max != -INFINITY) {  // else no key of this step is visible to row j
      Softmax& s = state[j];
      const float new_max = fmaxf(s.max, step_max);
      const float rescale = exp2f(s.max - new_max);
      s.sum *= rescale;
#pragma unroll
      for (int e = 0; e < 8; ++e) s.acc[e] *= rescale;
#pragma unroll
      for (int u = 0; u < KEYS; ++u) {
        const float p = exp2f(score[u] - new_max);
        s.sum += p;
        const float p_value = p * value_fold;
#pragma unroll
        for (int e = 0; e < 8; ++e) s.acc[e] = fmaf(p_value, v[u][e], s.acc[e]);
      }
      s.max = new_max;
    }
  }
}

// The lane groups of a warp (LANES lanes each) saw different keys: fold their states together, so that
// every group ends with the warp's.
template <int ROWS, int LANES>
__device__ __forceinline__ void fold_lane_groups(Softmax (&state)[ROWS]) {
#pragma unroll
  for (int mask = LANES; mask < WARP_SIZE; mask *= 2) {
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      float other_acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) other_acc[e] = shfl_xor(state[j].acc[e], mask);
      const float other_max = shfl_xor(state[j].max, mask);
      const float other_sum = shfl_xor(state[j].sum, mask);
      merge(state[j], other_max, other_sum, other_acc);
    }
  }
}

}  // namespace lithos
