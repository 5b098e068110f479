"""langchain-openai against the in-process API: content-part messages, with_structured_output in
json_schema and function_calling modes, and bind_tools with a forced tool."""
import pytest
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.inproc_server import MODEL_NAME


class Trip(BaseModel):
    city: str = Field(json_schema_extra={"enum": ["Oslo", "Lima"]})
    days: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def llm(api_server):
    return ChatOpenAI(model=MODEL_NAME, base_url=api_server.url + "/v1", api_key="unused", max_tokens=60,
                      max_retries=0, temperature=0)


def test_content_parts_message(llm):
    reply = llm.invoke([HumanMessage(content=[{"type": "text", "text": "hi"}])])
    assert isinstance(reply.content, str) and reply.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm, method):
    trip = llm.with_structured_output(Trip, method=method).invoke("plan a trip")
    assert isinstance(trip, Trip) and trip.city in ("Oslo", "Lima") and 1 <= trip.days <= 9


def test_bind_tools_forced(llm):
    reply = llm.bind_tools([Trip], tool_choice="Trip").invoke("plan a trip")
    call = reply.tool_calls[0]
    assert call["name"] == "Trip" and Trip(**call["args"])
