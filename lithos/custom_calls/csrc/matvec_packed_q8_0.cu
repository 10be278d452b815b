// The packed-weight decode projections (matvec_packed.h) for q8_0 weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ8_0, q8_0);
