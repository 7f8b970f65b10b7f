"""The Apple Neural Engine backend (Core ML).

coremltools (and torchao, which ExecuTorch pulls in) log a dozen version and missing-native-library warnings at
import on Linux; none is actionable here, and they would bury npumoe's own output. They are quieted here, on the
package, so every way in (a build, ``npumoe lint``, an ane export) has them quiet, not only the backend's module.
"""

import logging

for _noisy in ("coremltools", "torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
