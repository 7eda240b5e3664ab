"""The sentences the ONNX int8 recipe is calibrated on and gated on, and how they become feeds."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

Feeds = dict[str, np.ndarray]

# Two disjoint sets: static quantization calibrates on the first, the quality gate measures on the
# second, so the gate never scores sentences the scales were fitted to. Both mix lengths, code,
# other languages, emoji, questions and odd punctuation, because a quantized model fails first on
# inputs unlike the ones it was tuned on.
CALIBRATION_SENTENCES: tuple[str, ...] = (
    "The cat sat on the mat.",
    "How do I reset my password?",
    "Stock markets fell sharply after the central bank raised interest rates by half a point.",
    "def add(a, b):\n    return a + b",
    "Der Zug nach München hat heute zwanzig Minuten Verspätung.",
    "I love this song so much 😍🎶",
    "What is the capital of Australia?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name;",
    "ok",
    "Please find attached the quarterly report for your review before Monday's meeting.",
    "Ich habe keine Ahnung, wovon du sprichst.",
    "Why is the sky blue during the day but red at sunset?",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "The quick brown fox jumps over the lazy dog.",
    "Our new espresso machine makes a surprisingly good flat white. ☕",
    "In 1969, Apollo 11 landed the first humans on the Moon.",
    "Can you recommend a good Italian restaurant near the train station?",
    "The patient presented with acute chest pain radiating to the left arm.",
    "import numpy as np\nx = np.linspace(0, 1, 100)",
    "Wie viel kostet eine Fahrkarte nach Berlin?",
    "Terms and conditions apply. Offer valid while stocks last.",
    "The mitochondria is the powerhouse of the cell.",
    "lol that's hilarious 😂😂😂",
    "Error: connection refused (ECONNREFUSED) at 127.0.0.1:5432",
    "She walked along the beach, collecting shells as the tide went out and the gulls circled overhead.",
    "Is it safe to eat raw cookie dough?",
    "A recursive function calls itself until it reaches a base case.",
    "Le chat dort sur le canapé depuis ce matin.",
    "The committee will vote on the proposal next Thursday.",
    "git rebase -i HEAD~3",
    "Climate change is increasing the frequency of extreme weather events around the world.",
    "Thanks!",
    "How many legs does a spider have?",
    "Das Wetter ist heute schön, aber morgen soll es regnen.",
    "The violinist played the final movement with astonishing precision and warmth.",
    "{\"id\": 42, \"name\": \"widget\", \"tags\": [\"a\", \"b\"]}",
    "My flight got cancelled and the airline won't refund me. 😡",
    "Neural networks learn representations by adjusting weights through gradient descent.",
    "Where can I buy fresh sourdough bread on Sundays?",
    "The museum's new exhibition explores the history of early photography.",
    "x = [i ** 2 for i in range(10) if i % 2 == 0]",
    "Happy birthday!!! 🎉🎂",
    "The contract terminates automatically if either party fails to pay within thirty days.",
    "Kannst du mir bitte das Salz reichen?",
    "Who wrote the novel 'One Hundred Years of Solitude'?",
    "Regular exercise reduces the risk of heart disease and improves mood.",
    "The server returned HTTP 503 Service Unavailable for every request after the deploy.",
    "A single sentence can carry a surprising amount of meaning when every word is chosen with care.",
    "What's the difference between a list and a tuple in Python?",
    "Volcanic eruptions can cool the global climate for several years.",
    "The kids built a snowman in the garden this morning. ⛄",
    "rm -rf node_modules && npm install",
    "Die Konferenz findet im großen Saal im dritten Stock statt.",
    "Please do not reply to this automated message.",
    "The hikers reached the summit just before the storm rolled in from the west.",
    "Which vaccine schedule is recommended for infants?",
    "class Stack:\n    def __init__(self):\n        self.items = []",
    "Honestly the sequel was better than the original.",
    "The company reported record revenue but warned of slower growth next year.",
    "¿Dónde está la biblioteca?",
    "Bees communicate the location of flowers through a waggle dance.",
    "I can't believe it's already December 🎄",
    "Tokenization splits text into subword units before the model sees it.",
    "When the river flooded last spring, the whole village worked through the night to fill sandbags, "
    "move the animals to higher ground and carry the elderly out of their homes, and by morning the "
    "water had reached the church steps but not a single person had been hurt.",
)

HELDOUT_SENTENCES: tuple[str, ...] = (
    "A man is playing the guitar on a street corner.",
    "How long should I boil an egg for a runny yolk?",
    "The government announced a new tax on sugary drinks starting next year.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Ich würde gerne einen Tisch für zwei Personen reservieren.",
    "Best day ever at the beach 🏖️☀️",
    "What is the boiling point of water at high altitude?",
    "Enzymes speed up chemical reactions without being consumed.",
    "UPDATE orders SET status = 'shipped' WHERE id = 1017;",
    "yes",
    "Kindly confirm your attendance at the annual general meeting by Friday.",
    "Warum ist die Banane krumm?",
    "Why do cats purr when they are happy?",
    "while (node != NULL) { node = node->next; count++; }",
    "Five boxing wizards jump quickly.",
    "Just finished a 10k run, legs are jelly 🏃‍♀️💦",
    "The Berlin Wall fell in November 1989.",
    "Could you explain how a mortgage works?",
    "The MRI showed a small tear in the rotator cuff.",
    "import pandas as pd\ndf = pd.read_csv('data.csv')",
    "Wann öffnet das Schwimmbad am Wochenende?",
    "Batteries not included.",
    "DNA carries the genetic instructions for the development of living organisms.",
    "omg no way 😱",
    "Traceback (most recent call last): KeyError: 'user_id'",
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp, "
    "even after the ships had stopped coming.",
    "Is coffee bad for your health?",
    "A hash table maps keys to values using a hash function.",
    "Nous allons au marché tous les samedis matin.",
    "The board approved the merger after a lengthy debate.",
    "docker run -p 8080:80 nginx",
    "Rising sea levels threaten coastal cities across the globe.",
    "Cheers mate",
    "How far is the Moon from the Earth?",
    "Morgen früh fahre ich mit dem Fahrrad zur Arbeit.",
    "The orchestra's performance of the symphony received a standing ovation.",
    "[1, 2, 3].map(x => x * 2).filter(x => x > 2)",
    "Worst customer service I have ever experienced 👎",
    "Transformers use self-attention to weigh the importance of each token.",
    "Where is the nearest pharmacy that is open late?",
    "The gallery is showing a retrospective of the painter's late works.",
    "sorted(items, key=lambda item: item.price, reverse=True)",
    "Congratulations on your graduation! 🎓",
    "The tenant must give two months' notice before vacating the property.",
    "Hast du schon die neuen Nachrichten gelesen?",
    "Who painted the ceiling of the Sistine Chapel?",
    "Drinking enough water helps regulate body temperature.",
    "Latency spiked to 900 ms at p99 after we enabled TLS on the load balancer.",
    "Sometimes the smallest kindness makes the biggest difference in someone's day.",
    "What does the 'yield' keyword do in Python?",
    "Earthquakes occur when tectonic plates suddenly slip past each other.",
    "Our dog learned to open the fridge 🐶",
    "kubectl get pods --all-namespaces",
    "Der Vortrag beginnt um halb neun im Hörsaal B.",
    "This email was sent from an unmonitored address.",
    "The sailors watched the storm clouds gather on the horizon.",
    "What are the symptoms of vitamin D deficiency?",
    "struct Point { double x; double y; };",
    "The food was fine but the music was way too loud.",
    "Inflation slowed for the third consecutive month.",
    "Il pleut depuis trois jours sans arrêt.",
    "Octopuses have three hearts and blue blood.",
    "Can't wait for the weekend 🙌",
    "Quantization maps floating point values to a small set of integers.",
    "After three years of planning, the city finally opened the new library, a bright building of glass "
    "and timber with a children's floor, quiet reading rooms, a makerspace full of 3D printers and a "
    "rooftop garden where volunteers grow vegetables for the food bank down the street.",
)


def batches(sentences: Sequence[str], feeds: Callable[[list[str]], Feeds], batch_size: int) -> list[Feeds]:
    """The sentences as ONNX feeds, `batch_size` at a time."""
    return [feeds(list(sentences[i:i + batch_size])) for i in range(0, len(sentences), batch_size)]


def calibration_feeds(feeds: Callable[[list[str]], Feeds], count: int = len(CALIBRATION_SENTENCES)) -> list[Feeds]:
    """The first `count` calibration sentences (cycled), alone and in padded batches of 16."""
    sentences = [CALIBRATION_SENTENCES[i % len(CALIBRATION_SENTENCES)] for i in range(count)]
    return batches(sentences, feeds, 1) + batches(sentences, feeds, 16)
