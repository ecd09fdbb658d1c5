"""sentineld.agent: lives in the training process; records, keeps, exports and captures.

Importing it pulls in torch, h5py (lazily, when a capture is written) and prometheus-client, but
never apprise or watchdog.
"""

from .agent_config import AgentConfig
from .attach import attach
from .watch import Watch

__all__ = ["attach", "Watch", "AgentConfig"]
