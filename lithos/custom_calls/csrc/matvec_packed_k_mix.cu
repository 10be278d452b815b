// The packed-weight decode projections (matvec_packed.h) for k_mix weights (K-quant layers of mixed types).
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kKMix, k_mix);
