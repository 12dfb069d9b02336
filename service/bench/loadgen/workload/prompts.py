"""The built-in prompt set of `bench serve --dataset builtin`: written for this project, free to ship.

A mix a chat service sees: short questions, instructions, code, and long inputs to summarize or extract from.
Each prompt carries the output length (max_tokens) it is sent with unless --output-len overrides it.
"""

_HARBOUR = (
    "The harbour town of Wrenmouth grew up around a single stone quay built in 1742 to load slate from the "
    "quarries inland. For a century the quay was the town: ships came in empty, left heavy, and the workers lived "
    "in rows of cottages climbing the hill behind it. When the railway reached the valley in 1861, slate began to "
    "leave by train instead, and the quay fell quiet within a decade. The town survived by turning to fishing, "
    "then, after the Second World War, to summer visitors who came for the narrow streets and the view of the "
    "bay. Today the old slate sheds hold a museum, two cafes and a boat builder who restores wooden dinghies. "
    "The population, about 2,400, roughly doubles in August, and the council is divided over whether to allow a "
    "marina that would bring money but cover the mudflats where wading birds feed in winter.")

_INCIDENT = (
    "Incident report, 14 March. At 09:12 the API gateway began returning 502 errors for about 30 percent of "
    "requests. The on-call engineer was paged at 09:15 and found that one of three upstream nodes had exhausted "
    "its file descriptors after a configuration change at 08:50 raised the keep-alive timeout from 5 to 300 "
    "seconds without raising the descriptor limit. The node was drained at 09:31 and errors stopped. The change "
    "was reverted at 09:40, the node was restarted and returned to service at 09:48. No data was lost. "
    "Follow-ups: add an alert on open descriptors above 80 percent of the limit, require a load test for any "
    "change to connection timeouts, and document the relation between keep-alive and descriptor use.")

_RECIPE = (
    "Ingredients: 400 g dried chickpeas soaked overnight, 1 onion, 3 cloves garlic, a bunch of parsley, a bunch "
    "of coriander, 2 teaspoons ground cumin, 1 teaspoon ground coriander, half a teaspoon baking soda, salt, oil "
    "for frying. Drain the chickpeas well; they must not be cooked. Grind them with the onion, garlic and herbs "
    "until the mixture holds together when pressed but is not a paste. Stir in the spices, baking soda and salt, "
    "and rest the mixture for 30 minutes in the fridge. Shape small patties, fry them in oil at 175 degrees "
    "Celsius for about 4 minutes until deep brown, and drain them on paper.")

_CODE = (
    "def merge(intervals):\n"
    "    intervals.sort()\n"
    "    out = []\n"
    "    for start, end in intervals:\n"
    "        if out and start < out[-1][1]:\n"
    "            out[-1][1] = max(out[-1][1], end)\n"
    "        else:\n"
    "            out.append([start, end])\n"
    "    return out\n")

BUILTIN_PROMPTS: tuple[tuple[str, int], ...] = (
    ("What is the capital of Australia?", 16),
    ("Name three primary colors.", 16),
    ("How many minutes are there in a day? Answer with the number only.", 8),
    ("Translate 'good morning' into Spanish, French and German.", 32),
    ("Give me a synonym for 'quick'.", 8),
    ("What does HTTP stand for?", 16),
    ("Is a tomato a fruit or a vegetable? Explain in one sentence.", 48),
    ("Write a haiku about a train leaving a station at night.", 40),
    ("Explain in two sentences why the sky is blue.", 64),
    ("List five things to pack for a weekend hiking trip.", 64),
    ("What is the difference between a list and a tuple in Python?", 96),
    ("Write a limerick about a cat who learns to play the piano.", 64),
    ("Suggest a name for a bakery that only sells bread made with rye.", 24),
    ("Describe the taste of a lemon to someone who has never had one.", 80),
    ("Give three tips for writing clear error messages in software.", 96),
    ("Why do leaves change color in autumn? Keep it short.", 80),
    ("What is a prime number? Give two examples.", 48),
    ("Write a short, polite email declining a meeting invitation for Friday afternoon.", 120),
    ("Explain what a hash table is to a new programmer.", 160),
    ("Write a Python function that returns the n-th Fibonacci number iteratively.", 128),
    ("Write a SQL query that returns the ten customers with the highest total order value from tables "
     "customers(id, name) and orders(id, customer_id, amount).", 128),
    ("Compare walking and cycling as ways to commute 5 kilometres in a city. Give pros and cons of each.", 200),
    ("Write the opening paragraph of a mystery story set in a lighthouse during a storm.", 200),
    ("Explain the difference between latency and throughput, with an example from everyday life.", 160),
    ("Plan a three-day itinerary for a first visit to a coastal city, one paragraph per day.", 256),
    ("Write a bash one-liner that counts the lines of every .py file under the current directory and prints "
     "the total.", 64),
    ("What are the main causes of inflation? Answer in a short paragraph.", 128),
    ("Give a step-by-step explanation of how to make a cup of tea.", 128),
    ("Write a dialogue of six lines between a robot and a gardener about weeds.", 160),
    ("Explain what continuous batching means for a server that generates text with a language model.", 200),
    ("Summarize the following text in three sentences.\n\n" + _HARBOUR, 96),
    ("List the dates, years and numbers mentioned in this text, each with what it refers to.\n\n" + _HARBOUR, 160),
    ("Write a headline and a one-paragraph news story based on these facts.\n\n" + _HARBOUR, 200),
    ("Summarize this incident report for a manager in four bullet points.\n\n" + _INCIDENT, 128),
    ("What was the root cause of the incident below, and how long did users see errors?\n\n" + _INCIDENT, 96),
    ("Turn this incident report into a timeline table with the columns time and event.\n\n" + _INCIDENT, 200),
    ("Rewrite this recipe as a numbered list of steps.\n\n" + _RECIPE, 200),
    ("How long does the recipe below take from start to finish, not counting the overnight soaking?\n\n"
     + _RECIPE, 64),
    ("This function should merge overlapping intervals. Find the bug and show the fixed code.\n\n" + _CODE, 200),
    ("Write unit tests for this function with pytest, covering empty input, touching intervals and nested "
     "intervals.\n\n" + _CODE, 256),
)
