// The packed-weight decode projections (matvec_packed.h) for mxfp4 weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kMxfp4, mxfp4);
