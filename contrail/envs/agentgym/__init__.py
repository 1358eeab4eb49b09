"""AgentGym's HTTP environment protocol, both ways.

- Client: the spec ``agentgym:<env>@http://<host>:<port>`` (for instance
  ``agentgym:webshop@http://127.0.0.1:36001``) plays an AgentGym
  ``agentenv-*`` server as a contrail environment (`AgentGymEnv`).
- Server: `EnvServer` (``contrail serve-env <env> --port N``) serves any
  contrail environment so AgentGym's own clients play it unchanged.

The wire format of each AgentGym server is one `Dialect` in
`contrail.envs.agentgym.protocol`.
"""

from contrail.envs.agentgym.client import FAMILY, AgentGymEnv, parse_remote, remote_class
from contrail.envs.agentgym.protocol import DIALECTS, Dialect, RemoteEnvError, dialect
from contrail.envs.agentgym.server import EnvServer
from contrail.envs.base import register_family

register_family(FAMILY, remote_class)

__all__ = [
    "DIALECTS", "AgentGymEnv", "Dialect", "EnvServer", "RemoteEnvError", "dialect", "parse_remote", "remote_class",
]
