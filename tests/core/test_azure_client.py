"""az:// parsing, credentials from the environment, and redaction: no server needed."""

from __future__ import annotations

import pytest
from modelstage.core.azure_client import AzureClient, AzureLocation, AzureOptions
from modelstage.core.errors import SpecError
from modelstage.core.formats import AZURE, format_for
from modelstage.core.location import parse_location

KEY = "c2VjcmV0LWtleS1Pa2FwaStOYXJ3aGFsKzA0NTE="


def test_az_uris_name_a_container_and_a_prefix() -> None:
    loc = AzureLocation.parse("az://models/llama/abc/")
    assert (loc.container, loc.prefix, loc.uri) == ("models", "llama/abc", "az://models/llama/abc/")
    assert loc.key("modelstage.json") == "llama/abc/modelstage.json"
    assert parse_location("az://models/x").kind == AZURE


@pytest.mark.parametrize(
    "uri", ["az://acct:secretkey@models/x", "az://models/x?sv=2024&sig=SECRETSIG", "az:///x"]
)
def test_credentials_in_an_az_uri_are_refused_without_repeating_them(uri: str) -> None:
    with pytest.raises(SpecError) as e:
        AzureLocation.parse(uri)
    assert "secretkey" not in str(e.value) and "SECRETSIG" not in str(e.value)
    assert "AZURE_STORAGE_CONNECTION_STRING" in str(e.value)


def test_options_read_the_variables_azure_tools_and_run_ai_read() -> None:
    cli = AzureOptions.from_env({"AZURE_STORAGE_ACCOUNT": "acct", "AZURE_STORAGE_KEY": KEY})
    runai = AzureOptions.from_env(
        {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_ACCOUNT_KEY": KEY}
    )
    assert (cli.account, cli.key) == (runai.account, runai.key) == ("acct", KEY)
    sas = AzureOptions.from_env({"AZURE_STORAGE_ACCOUNT": "a", "AZURE_STORAGE_SAS_TOKEN": "?sv=1"})
    assert sas.sas_token == "sv=1"
    assert KEY not in repr(cli)  # dataclass repr hides the key


def test_redaction_covers_the_key_the_connection_string_and_sas_signatures() -> None:
    conn = f"DefaultEndpointsProtocol=http;AccountName=acct;AccountKey={KEY};BlobEndpoint=http://127.0.0.1:1/acct;"
    client = AzureClient(AzureOptions.from_env({"AZURE_STORAGE_CONNECTION_STRING": conn}), "box")
    line = client.redact(f"failed: {conn} https://x/y?sv=1&sig=abcDEF%2B123 {KEY}")
    assert KEY not in line and "abcDEF" not in line and "sig=***" in line


def test_an_account_without_key_or_sas_says_what_to_set() -> None:
    options = AzureOptions.from_env({})
    with pytest.raises(SpecError, match="AZURE_STORAGE_CONNECTION_STRING"):
        AzureClient(options, "box")


def test_per_rank_formats_that_vllm_reads_from_azure_stage_there_others_are_refused() -> None:
    format_for("runai_streamer_sharded").check_destination(AZURE)
    format_for("runai_streamer").check_destination(AZURE)
    with pytest.raises(SpecError, match="stage to Azure Blob with --format runai_streamer_sharded"):
        format_for("sharded_state").check_destination(AZURE)
