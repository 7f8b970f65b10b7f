import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the shared harness modules beside the tests
