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
Sphinx configuration of the shared-cache fork's documentation.

Build it against the patched package (upstream 1.6.1 + overlay + patches) laid out in ``build/tree``::

    python build_backend/monai_sharedcache_build.py layout --if-stale
    PYTHONPATH=build/tree python -m sphinx -W --keep-going -b html docs/source docs/build/html

Nothing here needs the network: the theme is sphinx's bundled alabaster and there is no intersphinx.
"""

from __future__ import annotations

import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TREE = os.path.join(REPO, "build", "tree")

# prefer the patched tree when PYTHONPATH was not set (e.g. a plain `make html`), so that autodoc never documents an
# installed upstream MONAI by accident
if os.path.isdir(os.path.join(TREE, "monai")) and TREE not in sys.path:
    sys.path.insert(0, TREE)

import monai  # noqa: E402

# fails early if an upstream MONAI without the fork is imported
from monai.data import SharedCacheStore, create_shared_cache, transforms_hashing  # noqa: E402

# -- project ----------------------------------------------------------------------------------------------------------

project = "MONAI shared-cache fork"
author = "MONAI Consortium"
copyright = "MONAI Consortium"
version = monai.__version__.split("+")[0]
release = monai.__version__

# -- general ----------------------------------------------------------------------------------------------------------

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style "Args:", "Returns:", "Raises:" as in every MONAI docstring
    "sphinx.ext.extlinks",
]

# :issue:`5630` -> "#5630", linking to the upstream issue or pull request (GitHub redirects between the two)
extlinks = {"issue": ("https://github.com/Project-MONAI/MONAI/issues/%s", "#%s")}

templates_path: list[str] = []
exclude_patterns: list[str] = []
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
language = "en"
pygments_style = "sphinx"
highlight_language = "python3"

# no network: never fetch inventories, never check links
intersphinx_mapping: dict = {}

# -- autodoc ----------------------------------------------------------------------------------------------------------

autoclass_content = "both"  # MONAI documents the constructor arguments in __init__
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# keep signatures readable: no `from __future__` strings evaluated, no long default values expanded
autodoc_preserve_defaults = True

# napoleon's own Google sections only, as MONAI's docs build (tests/fork/test_conventions.py checks the docstrings)
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# -- html -------------------------------------------------------------------------------------------------------------

html_theme = "alabaster"
html_title = f"MONAI {release}"
html_theme_options = {
    "description": "CacheDataset runtime cache shared by DataLoader workers and DDP ranks",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "260px",
}
html_sidebars = {"**": ["about.html", "navigation.html", "relations.html", "searchbox.html"]}
html_static_path: list[str] = []
html_show_sourcelink = True

# -- quiet but strict ----------------------------------------------------------------------------------------------------

# importing monai under sphinx may emit deprecation warnings of third-party packages; they are not doc warnings
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

_ = SharedCacheStore, create_shared_cache, transforms_hashing  # imported above only as a check
