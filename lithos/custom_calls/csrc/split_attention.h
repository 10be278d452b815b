// What the two split-attention kernels share (flash-decoding: attention.cu, and the megakernel's
// mk_attention.h): the split plan taken from the positions on the device, a key position's slot in a
// linear or ring cache, and one query row's online-softmax state in the exp2 domain.
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

}  // namespace lithos
