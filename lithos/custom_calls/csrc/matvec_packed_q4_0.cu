// The packed-weight decode projections (matvec_packed.h) for q4_0 weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ4_0, q4_0);
