import sys
from pathlib import Path

# hwfixtures sits beside the tests; tests/ has no __init__.py, so put this folder on the path.
sys.path.insert(0, str(Path(__file__).parent))
