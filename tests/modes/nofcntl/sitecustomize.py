# Copyright (c) MONAI Consortium
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#     http://www.apache.org/licenses/LICENSE-2.0
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""
`./runtests.sh --unittests --mode nofcntl`: a Python without fcntl, as on Windows (``import fcntl`` fails), whose
processes start with spawn. Every interpreter started with this directory on PYTHONPATH (workers, ranks) inherits it.
"""

import multiprocessing
import sys

sys.modules["fcntl"] = None  # type: ignore[assignment]  # `import fcntl` now raises ImportError
multiprocessing.set_start_method("spawn", force=True)
