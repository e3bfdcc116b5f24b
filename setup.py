"""Package discovery for setuptools: the checkout root is the ``draftsmith`` package (pyproject maps
it with ``package-dir``), and every sub-package folder under it is found here, so a new recipe or
module folder ships in the wheel without joining a hand-kept list."""

from setuptools import find_packages, setup

NOT_PACKAGES = ["tests", "tests.*", "docs", "docs.*", "build", "build.*", "outputs", "outputs.*"]


def package_names() -> list[str]:
    """``draftsmith`` and every ``draftsmith.<folder>`` holding an ``__init__.py``."""
    return [
        "draftsmith",
        *(f"draftsmith.{name}" for name in find_packages(".", exclude=NOT_PACKAGES)),
    ]


if __name__ == "__main__":
    setup(packages=package_names())
