"""Which SGLang releases nrl-sglang was checked against, and the one-line refusal of others.

The worker drives ``sglang.Engine``'s weight-update calls (``begin_weight_update``,
``update_weights_from_tensor``, ``update_weights_from_distributed``, ``init_weights_update_group``,
``end_weight_update``) and its memory calls with the keywords of the release below;
plugins/nrl-sglang/tests/test_compat.py reads an installed SGLang's source for every
``self.engine.<method>(...)`` call in worker.py and names what moved.

Import-light: nothing here imports SGLang or torch.
"""

from __future__ import annotations

from nrl_core.errors import NrlError

CHECKED_SGLANG = ("0.5.23",)
"""SGLang releases whose ``Engine`` nrl-sglang's worker was checked against (the ``engine``
extra's pin); any ``.postN`` of them is accepted, any other release refused
(:func:`check_sglang_version`)."""


def check_sglang_version(version: str) -> None:
    """Raise :class:`~nrl_core.errors.NrlError` (one line naming ``version``) unless SGLang
    ``version`` is a release of :data:`CHECKED_SGLANG` (post and local versions count as their
    release)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        release = ()
    if release in {Version(v).release for v in CHECKED_SGLANG}:
        return
    raise NrlError(
        f"SGLang {version} was not checked against nrl-sglang (checked: "
        f"{', '.join(CHECKED_SGLANG)}); install sglang=={CHECKED_SGLANG[-1]} (`nrl venvs build "
        "sglang`, or nrl-sglang[engine])"
    )
