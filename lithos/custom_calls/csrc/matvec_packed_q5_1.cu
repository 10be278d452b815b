// The packed-weight decode projections (matvec_packed.h) for q5_1 weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kQ5_1, q5_1);
