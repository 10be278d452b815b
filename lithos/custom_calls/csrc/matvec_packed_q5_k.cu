// The packed-weight decode projections (matvec_packed.h) for q5_k weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ5_K, q5_k);
