// The packed-weight decode projections (matvec_packed.h) for q4_1 weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ4_1, q4_1);
