"""Passages, JSON schemas, regexes and choices for the structured-output tests on the bundled model."""

from __future__ import annotations

from typing import Any

PERSON = ("Maria Lopez is a 34-year-old architect who lives at 12 Harbour Street, Lisbon, 1100-148. She has "
          "designed 27 buildings, enjoys sailing, chess and painting, and can be reached at maria@example.com or "
          "+351912345678.")
PRODUCT = ("The Aurora X2 desk lamp costs 49.99 euros, is in stock, weighs 1.2 kg and comes in black or white. "
           "Customers rate it 4 out of 5 stars. It was released on 2023-05-14.")
WEATHER = ("Forecast for Oslo on 2024-01-09: temperature -7.5 degrees Celsius, wind 18 km/h from the north, "
           "humidity 81 percent, light snow in the morning.")
BOOK = ("'The Quiet River' by Anna Berg was published in 2019 by Northway Press. It has 312 pages, 14 chapters "
        "and won the Lumen Prize. Reviewers call it moving and slow.")
ORDER = ("Order 5521: two notebooks at 3.50 each, one pen at 1.20 and three folders at 2.00 each, shipped to "
         "Berlin on 2024-03-02 at 14:30.")

_STR = {"type": "string", "maxLength": 40}
SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    (PERSON, "the person's name and age", {
        "type": "object", "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}),
    (PERSON, "the person's name and, if given, email", {
        "type": "object", "properties": {"name": _STR, "email": {"type": "string", "format": "email"}},
        "required": ["name"]}),
    (PERSON, "the person and her job", {
        "type": "object", "properties": {
            "person": {"type": "object", "properties": {"name": _STR, "city": _STR}, "required": ["name", "city"]},
            "job": {"type": "object", "properties": {"title": _STR, "buildings": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 1000}},
                    "required": ["title"]}},
        "required": ["person", "job"]}),
    (PERSON, "her hobbies (one to three)", {
        "type": "object", "properties": {"hobbies": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3}},
        "required": ["hobbies"]}),
    (BOOK, "the reviewers' sentiment", {
        "type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"]}),
    (WEATHER, "the temperature in Celsius", {
        "type": "object", "properties": {"celsius": {"type": "number", "minimum": -60, "maximum": 60}},
        "required": ["celsius"]}),
    (PRODUCT, "whether the lamp is in stock", {
        "type": "object", "properties": {"in_stock": {"type": "boolean"}}, "required": ["in_stock"]}),
    (PERSON, "the postal code", {
        "type": "object", "properties": {"postal_code": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{3}$"}},
        "required": ["postal_code"]}),
    (PRODUCT, "the release date", {
        "type": "object", "properties": {"released": {"type": "string", "format": "date"}},
        "required": ["released"]}),
    (ORDER, "the items ordered", {
        "type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"name": _STR, "quantity": {"type": "integer", "minimum": 1,
                                                                        "maximum": 100}},
            "required": ["name", "quantity"]}}},
        "required": ["items"]}),
    (ORDER, "the item prices as a list of lists", {
        "type": "object", "properties": {"prices": {"type": "array", "maxItems": 3, "items": {
            "type": "array", "items": {"type": "number", "minimum": 0, "maximum": 100}, "maxItems": 2}}},
        "required": ["prices"]}),
    (BOOK, "the title (schema version 1)", {
        "type": "object", "properties": {"version": {"const": 1}, "title": _STR}, "required": ["version", "title"]}),
    (BOOK, "the number of pages, as a number or a short text", {
        "type": "object", "properties": {"pages": {"anyOf": [{"type": "integer"}, {"type": "string",
                                                                                  "maxLength": 10}]}},
        "required": ["pages"]}),
    (PERSON, "her middle name, or null", {
        "type": "object", "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["middle_name"]}),
    (WEATHER, "the humidity as a fraction strictly between 0 and 1", {
        "type": "object", "properties": {"humidity": {"type": "number", "exclusiveMinimum": 0,
                                                      "exclusiveMaximum": 1}},
        "required": ["humidity"]}),
    (PRODUCT, "the star rating", {
        "type": "object", "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}}, "required": ["stars"]}),
    (PERSON, "her home and work addresses", {
        "$defs": {"address": {"type": "object", "properties": {"street": _STR, "city": _STR},
                              "required": ["street", "city"]}},
        "type": "object", "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
        "required": ["home"]}),
    (ORDER, "the order code (3 to 6 characters)", {
        "type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}},
        "required": ["code"]}),
    (PRODUCT, "the lamp's colours", {
        "type": "array", "items": {"enum": ["black", "white", "red", "blue"]}, "minItems": 2, "maxItems": 4}),
    (BOOK, "the reviewers' main adjective", {"enum": ["moving", "slow", "boring", "funny"]}),
    (BOOK, "the book, its publisher and the publisher's city", {
        "type": "object", "properties": {"book": {"type": "object", "properties": {
            "title": _STR, "publisher": {"type": "object", "properties": {
                "name": _STR, "location": {"type": "object", "properties": {"city": _STR}}},
                "required": ["name"]}},
            "required": ["title", "publisher"]}},
        "required": ["book"]}),
    (BOOK, "the author and year as a pair", {
        "type": "object", "properties": {"pair": {"type": "array", "prefixItems": [
            _STR, {"type": "integer", "minimum": 1000, "maximum": 2100}], "items": False, "minItems": 2}},
        "required": ["pair"]}),
    (ORDER, "the shipping date and time", {
        "type": "object", "properties": {"shipped": {"type": "string", "format": "date-time"}},
        "required": ["shipped"]}),
    (WEATHER, "the wind speed rounded to a multiple of 5", {
        "type": "object", "properties": {"wind": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 200}},
        "required": ["wind"]}),
    (PRODUCT, "exactly two colours", {
        "type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["black", "white"]},
                                                     "minItems": 2, "maxItems": 2}},
        "required": ["colours"]}),
    (PERSON, "anything you know about her (all optional)", {
        "type": "object", "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "city": _STR}}),
    (PERSON, "her phone number", {
        "type": "object", "properties": {"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,13}$"}},
        "required": ["phone"]}),
    (WEATHER, "the temperature below zero as a negative integer", {
        "type": "object", "properties": {"degrees": {"type": "integer", "minimum": -50, "maximum": -1}},
        "required": ["degrees"]}),
    (PRODUCT, "the product: name, price, category, in stock", {
        "type": "object", "properties": {
            "name": _STR, "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "category": {"enum": ["lighting", "furniture", "kitchen"]}, "in_stock": {"type": "boolean"}},
        "required": ["name", "price", "category", "in_stock"]}),
    (BOOK, "the awards, if any", {
        "type": "object", "properties": {"awards": {"type": "array", "items": _STR, "maxItems": 2},
                                         "pages": {"type": "integer", "minimum": 1, "maximum": 5000}},
        "required": ["awards", "pages"]}),
    (WEATHER, "the forecast summary", {
        "type": "object", "properties": {
            "city": _STR, "date": {"type": "string", "format": "date"},
            "conditions": {"type": "array", "items": {"enum": ["snow", "rain", "sun", "wind", "fog"]},
                           "minItems": 1, "maxItems": 3},
            "wind": {"type": "object", "properties": {"kmh": {"type": "number", "minimum": 0, "maximum": 300},
                                                      "direction": {"enum": ["north", "south", "east", "west"]}},
                     "required": ["kmh", "direction"]}},
        "required": ["city", "date", "conditions", "wind"]}),
    (ORDER, "the order number and total quantity", {
        "type": "object", "properties": {"order": {"type": "integer", "minimum": 1, "maximum": 99999},
                                         "quantity": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["order", "quantity"]}),
]

REGEXES: list[tuple[str, str]] = [
    ("What is Maria's phone number? " + PERSON, r"\+[0-9]{12}"),
    ("Is the lamp in stock? Answer yes or no. " + PRODUCT, r"(yes|no)"),
    ("Who wrote the book? Give first and last name. " + BOOK, r"[A-Z][a-z]+ [A-Z][a-z]+"),
    ("When was the lamp released? " + PRODUCT, r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("Which colours does the lamp come in? " + PRODUCT, r"(black|white|red)( and (black|white|red))?"),
    ("How cold is it in Oslo, in degrees? " + WEATHER, r"-?[0-9]{1,2}(\.[0-9])? degrees"),
]

CHOICES: list[tuple[str, list[str]]] = [
    ("Is this review positive, negative or neutral? 'The lamp is great, I love it.'",
     ["positive", "negative", "neutral"]),
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    ("Which letter comes first in the alphabet? A, B, C or D?", ["A", "B", "C", "D"]),
]
