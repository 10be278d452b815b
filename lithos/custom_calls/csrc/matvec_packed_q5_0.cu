// The packed-weight decode projections (matvec_packed.h) for q5_0 weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ5_0, q5_0);
