"""Map the folder ``services/`` onto the one import package ``rlfleet``.

Everything else lives in pyproject.toml. Packages are found under ``services/`` and renamed
``services.x`` -> ``rlfleet.x``, so a new subpackage needs no edit here and nothing installs a
top-level ``services``.
"""

from setuptools import find_packages, setup

PACKAGES = ["rlfleet" + name[len("services") :] for name in find_packages(include=["services*"])]

setup(packages=PACKAGES, package_dir={"rlfleet": "services"})
