// The packed-weight decode projections (matvec_packed.h) for q2_k weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ2_K, q2_k);
