// The packed-weight decode projections (matvec_packed.h) for q3_k weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ3_K, q3_k);
