// The packed-weight decode projections (matvec_packed.h) for q6_k weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ6_K, q6_k);
