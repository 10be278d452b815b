// The packed-weight decode projections (matvec_packed.h) for iq4_nl weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kIq4Nl, iq4_nl);
