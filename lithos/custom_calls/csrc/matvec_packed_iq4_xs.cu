// The packed-weight decode projections (matvec_packed.h) for iq4_xs weights.
#include "matvec_packed.h"

LITHOS_PACKED_MATVEC_HANDLERS(kIq4Xs, iq4_xs);
