"""``mooncake.pg``: re-exports `elasticep.compat.mooncake.pg` (importing it registers the
"mooncake" and "mooncake-cpu" torch.distributed backends)."""

from elasticep.compat.mooncake.pg import *  # noqa: F403
from elasticep.compat.mooncake.pg import __all__  # noqa: F401
