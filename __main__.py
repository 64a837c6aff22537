"""dsv41-exl3: DeepSeek-V4.1-Flash (EXL3 2.9bpw) on DGX Sparks, verified by real logprobs."""

import pulumi

from components.config import ConfigError, from_stack
from components.deployment import Deployment

try:
    loaded = from_stack()
except ConfigError as err:
    # Before any resource or connection: the whole list, no traceback.
    raise pulumi.RunError(str(err)) from None

deployment = Deployment("deployment", loaded, pulumi.get_stack())
for key, value in deployment.outputs.items():
    pulumi.export(key, value)
