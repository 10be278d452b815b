// The packed-weight decode projections (matvec_packed.h) for q4_k weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ4_K, q4_k);
