"""callbacks.utils.notices: credentials in a metadata URL, split as urllib3 and requests split them."""

from __future__ import annotations

import base64

from callbacks.utils.notices import split_credentials, without_credentials


def test_a_password_holding_an_at_is_masked_to_the_last_at() -> None:
    text = "GET http://bob:MetaB@PWtail88@127.0.0.1:9/latest failed; s3://AKIA:se@cret@b/r too"
    assert without_credentials(text) == "GET http://***@127.0.0.1:9/latest failed; s3://***@b/r too"


def test_an_at_in_the_path_is_not_userinfo() -> None:
    assert without_credentials("http://host:9/a@b?x=c@d") == "http://host:9/a@b?x=c@d"


def test_basic_auth_takes_the_userinfo_up_to_the_last_at() -> None:
    url, headers = split_credentials("http://bob:MetaB@PWtail88@127.0.0.1:9/x")
    assert url == "http://127.0.0.1:9/x"
    assert base64.b64decode(headers["Authorization"].removeprefix("Basic ")).decode() == "bob:MetaB@PWtail88"
