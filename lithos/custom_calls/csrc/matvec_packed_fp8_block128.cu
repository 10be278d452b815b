// The packed-weight decode projections (matvec_packed.h) for fp8_block128 weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kFp8Block128, fp8_block128);
