// The packed-weight decode projections (matvec_packed.h) for mxfp8 weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kMxfp8, mxfp8);
