"""The tool-call suite of ``tessera eval tools``: ten tools (nested objects, enums, arrays, optional fields)
and 111 fixed cases, each offering three or four of them, some carrying an earlier call and its result. A case
says which tool a good answer calls and the arguments it must hold (the values of the keys it names)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF"]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Japanese"]
DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$", "description": "YYYY-MM-DD"}


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "description": "The current weather in a city",
        "parameters": _object(
            {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]
        ),
    },
    "convert_currency": {
        "description": "Convert an amount of money from one currency to another",
        "parameters": _object(
            {
                "amount": {"type": "number"},
                "from_currency": {"enum": CURRENCIES},
                "to_currency": {"enum": CURRENCIES},
            },
            ["amount", "from_currency", "to_currency"],
        ),
    },
    "create_event": {
        "description": "Add an event to the calendar",
        "parameters": _object(
            {
                "title": {"type": "string"},
                "date": DATE,
                "attendees": {"type": "array", "items": {"type": "string"}},
                "location": _object({"city": {"type": "string"}, "room": {"type": "string"}}, ["city"]),
            },
            ["title", "date"],
        ),
    },
    "search_products": {
        "description": "Search the shop's catalogue",
        "parameters": _object(
            {
                "query": {"type": "string"},
                "filters": _object(
                    {
                        "category": {"enum": ["books", "electronics", "clothing", "toys"]},
                        "max_price": {"type": "number"},
                    },
                    [],
                ),
                "sort": {"enum": ["price", "rating", "newest"]},
            },
            ["query"],
        ),
    },
    "send_email": {
        "description": "Send an email",
        "parameters": _object(
            {
                "to": {"type": "string"},
                "subject": {"type": "string"},
                "body": {"type": "string"},
                "cc": {"type": "array", "items": {"type": "string"}},
            },
            ["to", "subject", "body"],
        ),
    },
    "set_alarm": {
        "description": "Set an alarm",
        "parameters": _object(
            {
                "time": {"type": "string", "pattern": r"^\d{2}:\d{2}$", "description": "HH:MM, 24-hour"},
                "days": {"type": "array", "items": {"enum": WEEKDAYS}},
                "label": {"type": "string"},
            },
            ["time"],
        ),
    },
    "book_flight": {
        "description": "Book a flight",
        "parameters": _object(
            {
                "origin": {"type": "string"},
                "destination": {"type": "string"},
                "date": DATE,
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "cabin": {"enum": ["economy", "business", "first"]},
            },
            ["origin", "destination", "date"],
        ),
    },
    "get_stock_price": {
        "description": "The latest price of a stock, by its ticker symbol",
        "parameters": _object({"symbol": {"type": "string"}}, ["symbol"]),
    },
    "translate_text": {
        "description": "Translate a text into another language",
        "parameters": _object(
            {"text": {"type": "string"}, "target_language": {"enum": LANGUAGES}}, ["text", "target_language"]
        ),
    },
    "calculate": {
        "description": "Evaluate an arithmetic expression",
        "parameters": _object({"expression": {"type": "string"}}, ["expression"]),
    },
}


@dataclass
class Case:
    """One request: the conversation, the tools offered, the tool a good answer calls and what its
    arguments must hold (keys to values; a list matches in any order, strings ignore case)."""

    name: str
    messages: list[dict[str, Any]]
    tools: list[str]
    expected_tool: str
    expected_arguments: dict[str, Any] = field(default_factory=dict)

    def openai_tools(self, strict: bool | None = None) -> list[dict[str, Any]]:
        extra = {} if strict is None else {"strict": strict}
        return [{"type": "function", "function": {"name": n, **TOOLS[n], **extra}} for n in self.tools]


def _ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _with_result(first: str, tool: str, arguments: dict[str, Any], result: str, then: str) -> list[dict]:
    """A conversation whose first question was answered by a call and its result, then a second question."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": tool, "arguments": json.dumps(arguments)},
    }
    return [
        {"role": "user", "content": first},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "user", "content": then},
    ]


def _cases() -> list[Case]:
    cases: list[Case] = []

    def add(name, messages, tools, tool, arguments):
        cases.append(Case(f"{name}-{len(cases):03d}", messages, tools, tool, arguments))

    weather = ["get_weather", "get_stock_price", "calculate"]
    for city in ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Cairo", "Lima", "Sydney"]:
        add("weather", _ask(f"What is the weather like in {city} right now?"), weather, "get_weather",
            {"city": city})  # fmt: skip
    for city, unit in [("Chicago", "fahrenheit"), ("Vienna", "celsius"), ("Denver", "fahrenheit")]:
        add("weather-unit", _ask(f"How warm is it in {city}? Tell me in {unit}."), weather, "get_weather",
            {"city": city, "unit": unit})  # fmt: skip

    money = ["convert_currency", "calculate", "get_stock_price"]
    for amount, a, b, text in [
        (100, "USD", "EUR", "Convert 100 US dollars to euros."),
        (250, "EUR", "USD", "How many dollars do I get for 250 euros?"),
        (40, "GBP", "JPY", "Change 40 pounds into Japanese yen."),
        (1000, "JPY", "USD", "What is 1000 yen in US dollars?"),
        (75.5, "CHF", "EUR", "Convert 75.5 Swiss francs to euros."),
        (12, "EUR", "GBP", "I have 12 euros. How much is that in British pounds?"),
        (500, "USD", "CHF", "Convert 500 USD to CHF."),
        (3, "GBP", "USD", "What are 3 pounds worth in dollars?"),
        (60, "EUR", "JPY", "Exchange 60 euros for yen, please."),
        (20000, "JPY", "EUR", "How much is 20000 JPY in EUR?"),
        (8, "USD", "GBP", "Convert 8 dollars to pounds."),
        (150, "CHF", "USD", "150 Swiss francs in US dollars?"),
    ]:
        add("currency", _ask(text), money, "convert_currency",
            {"amount": amount, "from_currency": a, "to_currency": b})  # fmt: skip

    calendar = ["create_event", "send_email", "set_alarm"]
    for title, date, people, city, text in [
        ("Team meeting", "2026-03-02", ["Ana", "Ben"], "Berlin",
         "Schedule a team meeting on 2026-03-02 in Berlin with Ana and Ben."),
        ("Dentist", "2026-04-15", [], "Lyon", "Put a dentist appointment in my calendar for 2026-04-15 in Lyon."),
        ("Launch party", "2026-06-01", ["Chloe", "Dan", "Eve"], "Austin",
         "Create an event 'Launch party' on 2026-06-01 in Austin; invite Chloe, Dan and Eve."),
        ("Budget review", "2026-01-20", ["Finance team"], "London",
         "Add a budget review on 2026-01-20 in London with the finance team."),
        ("Yoga class", "2026-02-11", [], "Kyoto", "Add my yoga class on 2026-02-11 in Kyoto to the calendar."),
        ("Board meeting", "2026-05-05", ["Grace", "Hugo"], "Zurich",
         "Book a board meeting for 2026-05-05 in Zurich with Grace and Hugo."),
        ("Birthday dinner", "2026-07-19", ["Ivy"], "Naples",
         "Put Ivy's birthday dinner on 2026-07-19 in Naples in my calendar and invite Ivy."),
        ("Workshop", "2026-09-09", ["Jon", "Kim"], "Porto",
         "Create a workshop event on 2026-09-09 in Porto with Jon and Kim."),
        ("Interview", "2026-10-30", ["Leo"], "Dublin",
         "Schedule an interview with Leo on 2026-10-30 in Dublin."),
        ("Concert", "2026-12-12", [], "Vienna", "Add a concert on 2026-12-12 in Vienna to my calendar."),
    ]:  # fmt: skip
        arguments = {"title": title, "date": date, "location": {"city": city}}
        if people:
            arguments["attendees"] = people
        add("event", _ask(text), calendar, "create_event", arguments)

    shop = ["search_products", "get_stock_price", "translate_text", "calculate"]
    for query, category, price, sort, text in [
        ("headphones", "electronics", 100, None, "Find headphones in electronics under 100 dollars."),
        ("science fiction", "books", None, "rating", "Show me the best rated science fiction books."),
        ("winter jacket", "clothing", 200, "price", "Search for a winter jacket under 200, cheapest first."),
        ("lego", "toys", None, "newest", "What are the newest lego toys?"),
        ("laptop", "electronics", 1500, None, "Look for a laptop that costs at most 1500."),
        ("cookbook", "books", 30, None, "Find me a cookbook for less than 30 dollars."),
        ("running shoes", "clothing", None, "rating", "Search running shoes, best rated first."),
        ("puzzle", "toys", 25, None, "I want a puzzle toy under 25."),
        ("phone charger", "electronics", None, "price", "Find a phone charger, sorted by price."),
        ("history", "books", None, "newest", "Show the newest history books."),
    ]:
        arguments = {"query": query, "filters": {"category": category}}
        if price is not None:
            arguments["filters"]["max_price"] = price
        if sort is not None:
            arguments["sort"] = sort
        add("products", _ask(text), shop, "search_products", arguments)

    mail = ["send_email", "create_event", "translate_text"]
    for to, subject, cc, text in [
        ("ana@example.com", "Report", [], "Email ana@example.com with the subject 'Report' saying the report is done."),
        ("ben@example.com", "Lunch", [], "Send ben@example.com an email, subject 'Lunch', asking if he is free at noon."),
        ("team@example.com", "Release", ["cto@example.com"],
         "Write to team@example.com, cc cto@example.com, subject 'Release': the release ships Friday."),
        ("hr@example.com", "Holiday", [], "Email hr@example.com about my holiday (subject 'Holiday'): I am off in May."),
        ("chloe@example.com", "Thanks", [], "Send a thank-you email to chloe@example.com with subject 'Thanks'."),
        ("ops@example.com", "Outage", ["sre@example.com"],
         "Mail ops@example.com with subject 'Outage', cc sre@example.com: the site is down."),
        ("dan@example.com", "Invoice", [], "Email dan@example.com, subject 'Invoice', that the invoice is attached."),
        ("eve@example.com", "Meeting notes", [],
         "Send eve@example.com the meeting notes by email, subject 'Meeting notes'."),
        ("sales@example.com", "Quote", ["boss@example.com"],
         "Email sales@example.com asking for a quote, subject 'Quote', and cc boss@example.com."),
        ("kim@example.com", "Welcome", [], "Send kim@example.com a welcome email with the subject 'Welcome'."),
    ]:  # fmt: skip
        arguments = {"to": to, "subject": subject}
        if cc:
            arguments["cc"] = cc
        add("email", _ask(text), mail, "send_email", arguments)

    alarm = ["set_alarm", "create_event", "get_weather"]
    for time, days, text in [
        ("07:00", [], "Wake me up at 07:00."),
        (
            "06:30",
            ["monday", "wednesday", "friday"],
            "Set an alarm for 06:30 on Monday, Wednesday and Friday.",
        ),
        ("22:15", [], "Set an alarm at 22:15 tonight."),
        ("08:00", ["saturday", "sunday"], "I need an alarm at 08:00 on weekends: Saturday and Sunday."),
        ("05:45", ["tuesday"], "Alarm at 05:45 every Tuesday."),
        ("13:00", [], "Remind me with an alarm at 13:00."),
        ("09:30", ["thursday"], "Set an alarm for 09:30 on Thursday."),
        ("18:00", ["monday", "tuesday"], "Alarm at 18:00 on Monday and Tuesday, please."),
        ("11:11", [], "Set an alarm for 11:11."),
        ("07:45", ["friday"], "Wake me at 07:45 on Friday."),
    ]:
        arguments = {"time": time}
        if days:
            arguments["days"] = days
        add("alarm", _ask(text), alarm, "set_alarm", arguments)

    travel = ["book_flight", "get_weather", "convert_currency"]
    for origin, destination, date, passengers, cabin, text in [
        ("Paris", "New York", "2026-05-10", None, None, "Book a flight from Paris to New York on 2026-05-10."),
        ("London", "Tokyo", "2026-08-01", 2, None, "Book 2 seats from London to Tokyo on 2026-08-01."),
        ("Berlin", "Rome", "2026-03-15", None, "business", "Fly me business class from Berlin to Rome on 2026-03-15."),
        ("Madrid", "Lisbon", "2026-04-04", 3, "economy",
         "Book 3 economy tickets from Madrid to Lisbon for 2026-04-04."),
        ("Oslo", "Chicago", "2026-11-20", None, "first", "I want a first class flight Oslo to Chicago on 2026-11-20."),
        ("Sydney", "Auckland", "2026-02-02", 4, None, "Book a flight Sydney to Auckland on 2026-02-02 for 4 people."),
        ("Cairo", "Athens", "2026-06-18", None, None, "Get me a flight from Cairo to Athens on 2026-06-18."),
        ("Toronto", "Miami", "2026-12-24", 2, "economy",
         "Two economy seats from Toronto to Miami on 2026-12-24, please."),
        ("Dublin", "Boston", "2026-09-03", None, None, "Book a Dublin to Boston flight on 2026-09-03."),
        ("Seoul", "Bangkok", "2026-07-07", 1, "business",
         "One business class seat from Seoul to Bangkok on 2026-07-07."),
    ]:  # fmt: skip
        arguments = {"origin": origin, "destination": destination, "date": date}
        if passengers is not None:
            arguments["passengers"] = passengers
        if cabin is not None:
            arguments["cabin"] = cabin
        add("flight", _ask(text), travel, "book_flight", arguments)

    stocks = ["get_stock_price", "convert_currency", "calculate"]
    for symbol, text in [
        ("AAPL", "What is Apple's stock price? Its ticker is AAPL."),
        ("MSFT", "Get the latest price of MSFT."),
        ("TSLA", "How much is TSLA trading at?"),
        ("NVDA", "Look up the stock price for NVDA."),
        ("AMZN", "What's the current price of AMZN shares?"),
        ("GOOG", "Price of GOOG stock right now?"),
        ("IBM", "Check the IBM stock price (ticker IBM)."),
        ("SAP", "What does SAP stock cost today? The symbol is SAP."),
    ]:
        add("stock", _ask(text), stocks, "get_stock_price", {"symbol": symbol})

    words = ["translate_text", "send_email", "search_products"]
    for phrase, language in [
        ("Good morning", "French"), ("Where is the station?", "German"), ("Thank you very much", "Spanish"),
        ("I love pizza", "Italian"), ("See you tomorrow", "Japanese"), ("The meeting is cancelled", "French"),
        ("How much does it cost?", "Spanish"), ("Happy birthday", "German"), ("Good night", "Italian"),
        ("Nice to meet you", "Japanese"),
    ]:  # fmt: skip
        add("translate", _ask(f"Translate '{phrase}' into {language}."), words, "translate_text",
            {"text": phrase, "target_language": language})  # fmt: skip

    maths = ["calculate", "convert_currency", "get_stock_price"]
    for expression, text in [
        ("17 * 23", "What is 17 * 23?"), ("1024 / 8", "Compute 1024 / 8."), ("3 + 4 * 5", "Calculate 3 + 4 * 5."),
        ("2 ** 10", "What is 2 ** 10?"), ("(15 + 5) / 4", "Evaluate (15 + 5) / 4."),
        ("99 - 42", "How much is 99 - 42?"), ("12.5 * 4", "Calculate 12.5 * 4."), ("7 * 7 * 7", "What's 7 * 7 * 7?"),
    ]:  # fmt: skip
        add("calculate", _ask(text), maths, "calculate", {"expression": expression})

    # Conversations: the first question was answered by a call and its result; the next asks for another call.
    follow_ups = [
        ("What is the weather in Paris?", "get_weather", {"city": "Paris"}, '{"temperature": 18, "sky": "sunny"}',
         "And in London?", weather, "get_weather", {"city": "London"}),
        ("Weather in Tokyo?", "get_weather", {"city": "Tokyo"}, '{"temperature": 25, "sky": "rain"}',
         "What about Osaka?", weather, "get_weather", {"city": "Osaka"}),
        ("Convert 100 USD to EUR.", "convert_currency", {"amount": 100, "from_currency": "USD", "to_currency": "EUR"},
         '{"result": 92.1}', "Now convert 100 USD to GBP.", money, "convert_currency",
         {"amount": 100, "from_currency": "USD", "to_currency": "GBP"}),
        ("Price of AAPL?", "get_stock_price", {"symbol": "AAPL"}, '{"price": 231.4}',
         "And the price of MSFT?", stocks, "get_stock_price", {"symbol": "MSFT"}),
        ("What is 6 * 7?", "calculate", {"expression": "6 * 7"}, '{"value": 42}',
         "Now compute 42 + 8.", maths, "calculate", {"expression": "42 + 8"}),
        ("Translate 'hello' into French.", "translate_text", {"text": "hello", "target_language": "French"},
         '{"translation": "bonjour"}', "Now translate 'hello' into German.", words, "translate_text",
         {"text": "hello", "target_language": "German"}),
        ("Weather in Berlin?", "get_weather", {"city": "Berlin"}, '{"temperature": 4, "sky": "snow"}',
         "Then book a flight from Berlin to Madrid on 2026-01-15.", travel, "book_flight",
         {"origin": "Berlin", "destination": "Madrid", "date": "2026-01-15"}),
        ("Find a laptop.", "search_products", {"query": "laptop"}, '{"results": ["X1", "M3"]}',
         "Search for laptop bags instead.", shop, "search_products", {"query": "laptop bags"}),
        ("Set an alarm at 07:00.", "set_alarm", {"time": "07:00"}, '{"ok": true}',
         "Also set one at 07:30.", alarm, "set_alarm", {"time": "07:30"}),
        ("Price of TSLA?", "get_stock_price", {"symbol": "TSLA"}, '{"price": 250.0, "currency": "USD"}',
         "Convert 250 USD to EUR.", money, "convert_currency",
         {"amount": 250, "from_currency": "USD", "to_currency": "EUR"}),
    ]  # fmt: skip
    for first, tool, arguments, result, then, offered, expected, expected_arguments in follow_ups:
        add(
            "follow-up",
            _with_result(first, tool, arguments, result, then),
            offered,
            expected,
            expected_arguments,
        )
    return cases


CASES: list[Case] = _cases()


def arguments_match(expected: Any, got: Any) -> bool:
    """Whether ``got`` holds ``expected``: objects on the expected keys, lists as multisets, strings without
    case or surrounding blanks, numbers by value."""
    if isinstance(expected, dict):
        return isinstance(got, dict) and all(
            k in got and arguments_match(v, got[k]) for k, v in expected.items()
        )
    if isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            return False
        return sorted(map(_normal, expected)) == sorted(map(_normal, got))
    if isinstance(expected, str):
        return isinstance(got, str) and _normal(expected) == _normal(got)
    if isinstance(expected, bool) or not isinstance(expected, int | float):
        return expected == got
    return isinstance(got, int | float) and not isinstance(got, bool) and float(got) == float(expected)


def _normal(value: Any) -> str:
    return value.strip().lower() if isinstance(value, str) else json.dumps(value, sort_keys=True)
