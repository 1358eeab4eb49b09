"""The procedurally generated WebShop catalogue.

The real WebShop serves 1.18M scraped Amazon products; here a seeded generator
writes a few thousand products over ~60 product types in 11 top categories.
Each product carries what WebShop's product records carry: an ASIN-like id,
a title, a ``query`` (the search phrase the product was "scraped" with: its
product type), a category path, attributes, option groups with values, a
price, a description, feature bullet points and reviews.

Realism that makes search and the reward matter:
- product types share words across categories (running *shoes* / walking
  *shoes*, yoga *pants* / jogger *pants*, usb c *cable* / hdmi *cable*,
  *shampoo* / pet *shampoo*, yoga *mat* / bath *mat*, laptop *stand* / tv
  *stand*), and attributes are shared by whole families (lightweight,
  waterproof, easy to clean ...);
- every type has dozens of products that differ in attributes, offered
  option values and price, so a goal's constraints pick out a few of them.

Everything is a pure function of the seed: ``random.Random`` with integer
seeds, fixed iteration orders, no ``hash()``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from typing import Any

CATALOG_VERSION = "1"

# --- option value lists --------------------------------------------------------

COLORS = (
    "black", "white", "navy blue", "grey", "red", "pink", "beige", "brown", "green",
    "light blue", "purple", "yellow", "khaki", "burgundy", "olive green", "charcoal",
)
SHOE_SIZES = ("6", "6.5", "7", "7.5", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12", "13")
APPAREL_SIZES = ("x-small", "small", "medium", "large", "x-large", "xx-large", "3x-large")
BED_SIZES = ("twin", "twin xl", "full", "queen", "king", "california king")
FLUID_SIZES = ("1 fl oz", "2 fl oz", "3.4 fl oz", "8 fl oz", "12 fl oz", "16 fl oz", "33.8 fl oz")
SCENTS = ("lavender", "unscented", "citrus", "coconut", "rose", "eucalyptus", "vanilla", "sandalwood", "fresh linen")
PAN_SIZES = ("8 inch", "10 inch", "12 inch", "14 inch")
GADGET_COLORS = ("black", "white", "silver", "space grey", "rose gold", "blue", "red", "green", "midnight")
CABLE_LENGTHS = ("1 ft", "3 ft", "6 ft", "10 ft", "15 ft")
PACKS = ("1 pack", "2 pack", "3 pack", "4 pack", "6 pack", "10 pack")
FOOD_SIZES = ("4 ounce", "8 ounce", "12 ounce", "16 ounce", "24 ounce", "32 ounce")
PET_SIZES = ("x-small", "small", "medium", "large", "x-large")
WOOD_FINISHES = ("walnut", "oak", "espresso", "white", "black", "grey wash", "natural", "cherry")
WEIGHTS = ("5 pounds", "10 pounds", "15 pounds", "20 pounds", "25 pounds", "30 pounds")
CAPACITIES = ("12 oz", "18 oz", "24 oz", "32 oz", "40 oz", "64 oz")
MODELS = ("iphone 13", "iphone 14", "iphone 15", "galaxy s22", "galaxy s23", "pixel 7", "pixel 8")
COUNTS = ("30 count", "60 count", "90 count", "120 count", "180 count", "240 count")
TEA_FLAVORS = ("jasmine", "mint", "lemon", "honey ginger", "peach", "original", "matcha")
CHOCOLATE_FLAVORS = ("sea salt", "almond", "orange", "raspberry", "mint", "original", "caramel")
SNACK_FLAVORS = ("original", "teriyaki", "peppered", "sweet and spicy", "honey bbq", "smoked")
CANDY_FLAVORS = ("assorted fruit", "sour", "cherry", "watermelon", "peach", "strawberry")
PET_FLAVORS = ("chicken", "beef", "salmon", "turkey", "lamb", "peanut butter")
BAR_FLAVORS = ("chocolate chip", "peanut butter", "cookies and cream", "birthday cake", "berry", "vanilla almond")

# --- families: shared attributes and option groups ------------------------------

# family -> (attributes shared by its types, option groups: name -> values)
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]]] = {
    "shoes": (
        ("lightweight", "non slip", "breathable", "rubber sole", "arch support", "memory foam",
         "waterproof", "slip resistant", "wide toe box"),
        (("size", SHOE_SIZES), ("color", COLORS)),
    ),
    "apparel": (
        ("machine washable", "quick dry", "moisture wicking", "relaxed fit", "lightweight",
         "breathable", "hand wash", "polyester spandex", "everyday wear"),
        (("size", APPAREL_SIZES), ("color", COLORS)),
    ),
    "outerwear": (
        ("waterproof", "windproof", "hooded", "zip closure", "machine washable", "lightweight",
         "packable", "fleece lined"),
        (("size", APPAREL_SIZES), ("color", COLORS)),
    ),
    "beauty": (
        ("paraben free", "cruelty free", "sulfate free", "long lasting", "natural ingredients",
         "sensitive skin", "dermatologist tested", "travel size", "vegan"),
        (("size", FLUID_SIZES), ("scent", SCENTS)),
    ),
    "beauty_tool": (
        ("easy to use", "long lasting", "high quality", "travel size", "cruelty free",
         "easy to clean", "lightweight"),
        (("color", COLORS),),
    ),
    "bedding": (
        ("machine washable", "easy care", "deep pocket", "wrinkle free", "breathable",
         "soft material", "fade resistant", "hypoallergenic"),
        (("size", BED_SIZES), ("color", COLORS)),
    ),
    "home_decor": (
        ("easy to clean", "machine washable", "fade resistant", "high quality", "modern design",
         "durable", "soft material", "easy care"),
        (("color", COLORS), ("pack", PACKS)),
    ),
    "kitchen": (
        ("dishwasher safe", "easy to clean", "bpa free", "heat resistant", "durable",
         "food grade", "easy to store"),
        (("size", PAN_SIZES), ("color", COLORS)),
    ),
    "appliance": (
        ("easy to clean", "stainless steel", "auto shut off", "dishwasher safe", "bpa free",
         "compact design", "programmable", "energy efficient"),
        (("color", GADGET_COLORS),),
    ),
    "audio": (
        ("wireless bluetooth", "long battery life", "noise cancelling", "water resistant",
         "easy to carry", "hi fi sound", "fast charging", "usb c", "hands free"),
        (("color", GADGET_COLORS),),
    ),
    "gadget": (
        ("fast charging", "long battery life", "usb c", "easy to carry", "plug and play",
         "water resistant", "durable", "compact design", "easy to use"),
        (("color", GADGET_COLORS), ("pack", PACKS)),
    ),
    "accessory": (
        ("durable", "easy to carry", "lightweight", "compact design", "easy install",
         "high quality", "anti slip", "portable"),
        (("color", GADGET_COLORS),),
    ),
    "cable": (
        ("fast charging", "braided nylon", "high speed", "durable", "gold plated", "plug and play",
         "tangle free", "usb c"),
        (("length", CABLE_LENGTHS), ("color", GADGET_COLORS), ("pack", PACKS)),
    ),
    "phone_accessory": (
        ("shockproof", "scratch resistant", "slim fit", "easy install", "wireless charging compatible",
         "bubble free", "high definition", "tempered glass"),
        (("model", MODELS), ("color", GADGET_COLORS)),
    ),
    "food": (
        ("gluten free", "non gmo", "keto friendly", "sugar free", "low calorie", "organic",
         "kosher", "no artificial flavors"),
        (("size", FOOD_SIZES),),
    ),
    "fitness": (
        ("non slip", "lightweight", "easy to carry", "eco friendly", "durable",
         "sweat resistant", "home gym", "latex free"),
        (("color", COLORS), ("size", APPAREL_SIZES)),
    ),
    "camping": (
        ("waterproof", "lightweight", "easy setup", "portable", "durable", "compact design",
         "windproof", "easy to carry"),
        (("color", COLORS), ("capacity", ("1 person", "2 person", "4 person", "6 person"))),
    ),
    "drinkware": (
        ("bpa free", "leak proof", "stainless steel", "double wall", "dishwasher safe",
         "keeps cold", "easy to carry", "lightweight"),
        (("capacity", CAPACITIES), ("color", COLORS)),
    ),
    "pet_gear": (
        ("machine washable", "non slip", "easy to clean", "durable", "chew resistant",
         "lightweight", "easy assembly", "pet safe"),
        (("size", PET_SIZES), ("color", COLORS)),
    ),
    "pet_care": (
        ("natural ingredients", "vet recommended", "made in usa", "pet safe", "long lasting",
         "easy to use", "no artificial colors"),
        (("size", FOOD_SIZES),),
    ),
    "household": (
        ("long lasting", "easy to use", "eco friendly", "value pack", "heavy duty",
         "hypoallergenic", "septic safe"),
        (("pack", PACKS), ("scent", SCENTS)),
    ),
    "supplement": (
        ("non gmo", "gluten free", "vegan", "third party tested", "easy to swallow",
         "sugar free", "high potency", "dairy free"),
        (("count", COUNTS),),
    ),
    "office": (
        ("easy to use", "high quality", "durable", "eco friendly", "compact design",
         "school supplies", "office supplies"),
        (("color", COLORS), ("pack", PACKS)),
    ),
    "furniture": (
        ("easy assembly", "space saving", "heavy duty", "modern design", "sturdy construction",
         "high quality", "easy to clean"),
        (("color", WOOD_FINISHES),),
    ),
    "toy": (
        ("educational", "non toxic", "easy to clean", "durable", "for kids", "gift set",
         "high quality", "eco friendly"),
        (("pack", PACKS), ("color", COLORS)),
    ),
    "tool": (
        ("heavy duty", "easy to use", "durable", "compact design", "professional grade",
         "long lasting", "rust resistant"),
        (("color", GADGET_COLORS),),
    ),
}


@dataclass(frozen=True)
class ProductType:
    """One kind of product: its search phrase, nouns, category and vocabulary."""

    name: str  # the product's ``query``: what a shopper types, e.g. "running shoes"
    nouns: tuple[str, ...]  # nouns that may appear in titles of this type
    category: tuple[str, str, str]
    family: str
    qualifiers: tuple[str, ...]  # words that refine the type in titles and goals
    attributes: tuple[str, ...]  # type-specific attributes, added to the family's
    price: tuple[float, float]
    use: str  # "for ..." phrase used in descriptions
    options: tuple[tuple[str, tuple[str, ...]], ...] = ()  # replaces the family's groups


def _t(name, nouns, category, family, qualifiers, attributes, price, use, options=()):
    return ProductType(
        name=name,
        nouns=tuple(nouns.split()),
        category=tuple(part.strip() for part in category.split("›")),
        family=family,
        qualifiers=tuple(q.strip() for q in qualifiers.split(",") if q.strip()),
        attributes=tuple(a.strip() for a in attributes.split(",") if a.strip()),
        price=price,
        use=use,
        options=options,
    )


_CSJ = "clothing, shoes & jewelry"
_AUDIENCE = "women's, men's"
PRODUCT_TYPES: tuple[ProductType, ...] = (
    # clothing, shoes & jewelry
    _t("running shoes", "shoes sneakers mesh", f"{_CSJ} › shoes › athletic", "shoes", f"{_AUDIENCE}, mesh, trail", "cushioned, knit upper", (29, 129), "for running, gym workouts and everyday training"),
    _t("walking shoes", "shoes sneakers leather", f"{_CSJ} › shoes › athletic", "shoes", f"{_AUDIENCE}, leather, slip on", "cushioned, easy to wear", (25, 110), "for walking, travel and long days on your feet"),
    _t("hiking boots", "boots leather suede", f"{_CSJ} › shoes › boots", "shoes", f"{_AUDIENCE}, leather, suede", "ankle support, lace up", (49, 189), "for hiking, trekking and rough trails"),
    _t("rain boots", "boots rubber", f"{_CSJ} › shoes › boots", "shoes", "women's, kids, rubber, mid calf", "easy to clean, pull on", (22, 79), "for rainy days, gardening and muddy yards"),
    _t("slippers", "slippers fleece", f"{_CSJ} › shoes › slippers", "shoes", f"{_AUDIENCE}, fleece, house", "faux fur, indoor outdoor", (12, 45), "for the house, lazy mornings and winter evenings"),
    _t("t-shirt", "shirt tee cotton", f"{_CSJ} › clothing › tops", "apparel", f"{_AUDIENCE}, cotton, graphic, v neck", "crew neck, soft material, short sleeve, long sleeve, cotton spandex", (9, 35), "for everyday wear, sports and casual outings"),
    _t("dress shirt", "shirt cotton oxford", f"{_CSJ} › clothing › shirts", "apparel", "men's, oxford, stretch, cotton", "wrinkle free, regular fit, long sleeve, button closure, slim fit", (19, 69), "for the office, weddings and formal events"),
    _t("hoodie", "hoodie sweatshirt fleece pullover", f"{_CSJ} › clothing › sweatshirts", "apparel", f"{_AUDIENCE}, fleece, pullover, zip up", "drawstring hood, kangaroo pocket, long sleeve, soft material", (19, 65), "for cool weather, workouts and lounging"),
    _t("yoga pants", "pants leggings", f"{_CSJ} › clothing › activewear", "apparel", "women's, flare, bootcut, pocket", "tummy control, four way stretch, high waist, slim fit", (15, 49), "for yoga, pilates and the gym"),
    _t("jogger pants", "pants joggers sweatpants", f"{_CSJ} › clothing › activewear", "apparel", f"{_AUDIENCE}, fleece, cargo, tapered", "elastic waist, drawstring closure, slim fit, high waist", (17, 55), "for jogging, travel and lounging"),
    _t("jeans", "jeans denim pants", f"{_CSJ} › clothing › pants", "apparel", f"{_AUDIENCE}, straight leg, skinny, bootcut", "stretch denim, classic fit, high waist, slim fit, button closure", (24, 89), "for everyday casual wear"),
    _t("summer dress", "dress sundress", f"{_CSJ} › clothing › dresses", "apparel", "women's, floral, maxi, midi", "flowy, adjustable strap, short sleeve, high waist", (19, 69), "for summer, beach days and parties"),
    _t("swim trunks", "trunks shorts swimwear", f"{_CSJ} › clothing › swimwear", "apparel", "men's, boys, board, floral", "mesh lining, elastic waist", (14, 42), "for the beach, pool and surfing"),
    _t("athletic socks", "socks", f"{_CSJ} › clothing › socks", "apparel", f"{_AUDIENCE}, ankle, crew, cushioned", "arch support, reinforced heel", (9, 29), "for running, sports and daily wear", (("size", ("small", "medium", "large", "x-large")), ("color", COLORS))),
    _t("rain jacket", "jacket raincoat shell", f"{_CSJ} › clothing › coats", "outerwear", f"{_AUDIENCE}, hiking, travel", "adjustable hood, sealed seams", (29, 119), "for rain, hiking and travel"),
    _t("winter coat", "coat parka jacket", f"{_CSJ} › clothing › coats", "outerwear", f"{_AUDIENCE}, puffer, down, long", "warm winter, faux fur", (49, 199), "for cold weather and snowy days"),
    _t("baseball cap", "cap hat", f"{_CSJ} › accessories › hats", "apparel", "men's, women's, trucker, washed cotton", "adjustable strap, sun protection", (8, 29), "for sun protection, sports and travel", (("color", COLORS),)),
    # beauty & personal care
    _t("shampoo", "shampoo hair", "beauty & personal care › hair care › shampoo", "beauty", "argan oil, tea tree, biotin, moisturizing", "dry hair, color safe", (6, 38), "for washing hair and a healthy scalp"),
    _t("conditioner", "conditioner hair", "beauty & personal care › hair care › conditioner", "beauty", "argan oil, coconut oil, deep, leave in", "dry hair, color safe", (6, 36), "for soft, detangled hair"),
    _t("face moisturizer", "moisturizer cream face lotion", "beauty & personal care › skin care › face", "beauty", "hyaluronic acid, night, oil free, spf", "fine lines, dry skin", (9, 59), "for daily hydration of the face"),
    _t("sunscreen lotion", "sunscreen lotion", "beauty & personal care › skin care › sun", "beauty", "mineral, spf 50, spf 30, sport", "water resistant, broad spectrum", (7, 32), "for sun protection at the beach and outdoors"),
    _t("body wash", "wash gel body", "beauty & personal care › bath & body › body wash", "beauty", "shea butter, charcoal, men's, exfoliating", "dry skin, rich lather", (5, 24), "for a refreshing daily shower"),
    _t("deodorant", "deodorant stick", "beauty & personal care › personal care › deodorant", "beauty", "aluminum free, men's, women's, natural", "odor protection, 24 hour", (5, 19), "for all day freshness", (("size", ("2.6 ounce", "3 ounce", "3.4 ounce")), ("scent", SCENTS))),
    _t("lip balm", "balm lip stick", "beauty & personal care › skin care › lip", "beauty", "tinted, shea butter, spf, beeswax", "dry lips, moisturizing", (3, 16), "for soft, protected lips", (("pack", PACKS), ("scent", SCENTS))),
    _t("hair extension", "extension hair wig clip", "beauty & personal care › hair care › extensions", "beauty_tool", "clip in, synthetic, human hair, wavy", "natural looking, heat resistant", (15, 89), "for instant length and volume", (("color", ("black", "dark brown", "light brown", "blonde", "auburn", "ombre")), ("size", ("14 inch", "18 inch", "22 inch", "26 inch")))),
    _t("hair dryer", "dryer hair blow", "beauty & personal care › hair care › tools", "beauty_tool", "ionic, travel, salon, diffuser", "fast drying, low noise", (19, 129), "for quick, frizz free drying"),
    _t("makeup brush set", "brush brushes makeup set", "beauty & personal care › makeup › tools", "beauty_tool", "synthetic, foundation, eyeshadow, travel", "soft bristles, storage case", (8, 39), "for foundation, powder and eye makeup"),
    _t("nail polish", "polish nail lacquer", "beauty & personal care › nails › polish", "beauty_tool", "gel, quick dry, glitter, matte", "chip resistant, high shine", (4, 22), "for salon quality manicures at home", (("color", COLORS), ("pack", PACKS))),
    # home & kitchen
    _t("bed sheet set", "sheet sheets set bedding microfiber", "home & kitchen › bedding › sheets", "bedding", "microfiber, cotton, bamboo, flannel", "cooling, four piece", (19, 99), "for a comfortable night's sleep"),
    _t("comforter", "comforter duvet bedding", "home & kitchen › bedding › comforters", "bedding", "down alternative, quilted, all season, reversible", "fluffy, corner tabs", (29, 139), "for warm, cozy nights in every season"),
    _t("bath towel", "towel towels cotton", "home & kitchen › bath › towels", "home_decor", "cotton, bamboo, oversized, turkish", "highly absorbent, quick dry", (12, 59), "for the bathroom, gym and pool"),
    _t("bath mat", "mat rug bath", "home & kitchen › bath › rugs", "home_decor", "memory foam, microfiber, chenille, absorbent", "quick dry, rubber backing, non slip", (9, 39), "for a dry, soft bathroom floor"),
    _t("shower curtain", "curtain shower liner", "home & kitchen › bath › shower", "home_decor", "fabric, waterproof, farmhouse, striped", "rust proof, weighted hem, easy install", (10, 39), "for the bathroom shower and tub"),
    _t("blackout curtains", "curtains curtain panels drapes", "home & kitchen › home decor › window", "home_decor", "thermal, grommet, linen, room darkening", "noise reducing, energy saving, living room, bedroom, easy install", (15, 69), "for bedrooms, nurseries and living rooms"),
    _t("throw pillow cover", "pillow cover covers cushion", "home & kitchen › home decor › pillows", "home_decor", "velvet, linen, boho, square", "hidden zipper, decorative, living room, bedroom", (8, 29), "for the couch, sofa and bed"),
    _t("area rug", "rug carpet", "home & kitchen › home decor › rugs", "home_decor", "shag, vintage, washable, outdoor", "stain resistant, low pile, non slip, living room", (29, 189), "for living rooms, bedrooms and dining rooms", (("color", COLORS), ("size", ("2x3 ft", "3x5 ft", "5x7 ft", "8x10 ft")))),
    _t("table lamp", "lamp light shade", "home & kitchen › lighting › lamps", "home_decor", "bedside, touch, usb, ceramic", "dimmable, led bulb, living room, bedroom", (19, 89), "for bedside tables, desks and living rooms", (("color", COLORS), ("pack", ("1 pack", "2 pack")))),
    _t("frying pan", "pan skillet cookware", "home & kitchen › kitchen & dining › cookware", "kitchen", "cast iron, ceramic, nonstick, deep", "scratch resistant, cool touch handle, non stick, oven safe, induction compatible, stainless steel", (15, 89), "for frying, searing and sauteing"),
    _t("knife set", "knife knives block set", "home & kitchen › kitchen & dining › cutlery", "kitchen", "german steel, japanese, chef, 15 piece", "ultra sharp, ergonomic handle, stainless steel, rust resistant", (25, 179), "for slicing, dicing and chopping", (("color", COLORS), ("pack", ("6 piece", "8 piece", "12 piece", "15 piece")))),
    _t("cutting board", "board cutting chopping", "home & kitchen › kitchen & dining › prep", "kitchen", "bamboo, plastic, wood, extra large", "juice groove, reversible, non slip", (9, 49), "for meal prep, carving and serving", (("size", ("small", "medium", "large", "extra large")), ("pack", ("1 pack", "2 pack", "3 pack")))),
    _t("coffee maker", "maker coffee brewer machine", "home & kitchen › kitchen & dining › coffee", "appliance", "drip, single serve, 12 cup, pour over", "keep warm, reusable filter", (25, 149), "for brewing coffee at home or the office"),
    _t("air fryer", "fryer air oven", "home & kitchen › kitchen & dining › appliances", "appliance", "digital, 5 quart, basket, compact", "oil free, preset programs", (49, 179), "for crispy food with little oil"),
    _t("electric kettle", "kettle water boiler", "home & kitchen › kitchen & dining › appliances", "appliance", "glass, gooseneck, 1.7 liter, cordless", "boil dry protection, fast boiling", (19, 79), "for tea, coffee and instant meals"),
    _t("storage bins", "bins bin baskets storage", "home & kitchen › storage & organization › bins", "home_decor", "fabric, foldable, lidded, cube", "sturdy handles, collapsible, space saving", (12, 45), "for closets, shelves and toy storage", (("color", COLORS), ("pack", ("2 pack", "4 pack", "6 pack", "8 pack")))),
    # electronics
    _t("bluetooth speaker", "speaker speakers", "electronics › portable audio › speakers", "audio", "portable, waterproof, outdoor, mini", "loud sound, deep bass", (19, 129), "for parties, the beach and the shower"),
    _t("wireless earbuds", "earbuds headphones earphones", "electronics › headphones › earbuds", "audio", "sport, in ear, true wireless, open ear", "charging case, built in microphone", (15, 149), "for workouts, calls and commuting"),
    _t("over ear headphones", "headphones headset", "electronics › headphones › over ear", "audio", "studio, foldable, gaming, kids", "comfortable fit, built in microphone", (25, 199), "for music, gaming and travel"),
    _t("usb c cable", "cable cord charger", "electronics › accessories › cables", "cable", "right angle, usb a to usb c, 60w, 100w", "data sync", (6, 25), "for charging phones, tablets and laptops"),
    _t("hdmi cable", "cable cord", "electronics › accessories › cables", "cable", "4k, 8k, short, ethernet", "gold plated, ultra hd", (6, 29), "for tvs, monitors and game consoles"),
    _t("phone charger", "charger adapter block", "electronics › accessories › chargers", "gadget", "wall, 20w, dual port, gan", "fast charging, foldable plug", (9, 39), "for phones, tablets and earbuds"),
    _t("power bank", "bank battery charger", "electronics › accessories › batteries", "gadget", "10000mah, 20000mah, magnetic, solar", "led display, dual output, portable", (15, 69), "for charging on the go"),
    _t("phone case", "case cover", "electronics › cell phone accessories › cases", "phone_accessory", "clear, leather, wallet, rugged", "raised edges, kickstand", (8, 39), "for everyday phone protection"),
    _t("screen protector", "protector glass film", "electronics › cell phone accessories › screen protectors", "phone_accessory", "privacy, matte, anti glare, full coverage", "case friendly, easy install", (6, 19), "for a scratch free screen", (("model", MODELS), ("pack", ("1 pack", "2 pack", "3 pack")))),
    _t("wireless mouse", "mouse", "electronics › computers › mice", "gadget", "ergonomic, silent, vertical, gaming", "adjustable dpi, usb receiver, ergonomic design, silent click", (9, 59), "for laptops, desktops and the office"),
    _t("mechanical keyboard", "keyboard keys", "electronics › computers › keyboards", "gadget", "rgb, wireless, compact, tenkeyless", "hot swappable, backlit, wired usb", (29, 149), "for gaming, typing and coding"),
    _t("laptop stand", "stand riser holder", "electronics › computers › stands", "accessory", "aluminum, adjustable, foldable, ergonomic", "anti slip, heat dissipation", (15, 59), "for desks, offices and working from home", (("color", GADGET_COLORS),)),
    _t("smart watch band", "band strap watch", "electronics › wearables › bands", "accessory", "silicone, leather, nylon, stainless steel", "quick release, adjustable", (7, 29), "for smart watches and fitness trackers", (("size", ("38mm", "40mm", "41mm", "44mm", "45mm")), ("color", COLORS))),
    # grocery & gourmet food
    _t("green tea", "tea bags leaf", "grocery & gourmet food › beverages › tea", "food", "loose leaf, tea bags, decaf, japanese", "caffeine free, antioxidant", (5, 29), "for a calm afternoon cup", (("flavor", TEA_FLAVORS), ("size", ("20 count", "50 count", "100 count")))),
    _t("coffee beans", "coffee beans roast", "grocery & gourmet food › beverages › coffee", "food", "whole bean, dark roast, medium roast, espresso", "fair trade, single origin", (9, 39), "for espresso, drip and french press", (("size", ("12 ounce", "16 ounce", "32 ounce", "5 pound")), ("flavor", ("original", "vanilla", "hazelnut", "caramel", "mocha")))),
    _t("dark chocolate", "chocolate bar bars cocoa", "grocery & gourmet food › snacks › chocolate", "food", "70% cacao, bars, truffles, squares", "rich taste, fair trade", (5, 35), "for snacking, baking and gifting", (("flavor", CHOCOLATE_FLAVORS), ("size", FOOD_SIZES))),
    _t("protein bars", "bars bar snack protein", "grocery & gourmet food › snacks › bars", "food", "whey, plant based, low carb, crispy", "meal replacement, 20g protein, individually wrapped, high protein", (12, 39), "for post workout snacks and busy days", (("flavor", BAR_FLAVORS), ("pack", ("12 pack", "15 pack", "20 pack")))),
    _t("beef jerky", "jerky beef meat snack", "grocery & gourmet food › snacks › jerky", "food", "grass fed, thick cut, peppered, original", "high protein, resealable bag, ready to eat", (7, 32), "for hiking, road trips and snacking", (("flavor", SNACK_FLAVORS), ("size", FOOD_SIZES))),
    _t("trail mix", "mix nuts snack", "grocery & gourmet food › snacks › nuts", "food", "mixed nuts, dried fruit, snack packs, tropical", "resealable bag, healthy snack, individually wrapped", (6, 28), "for hiking, school lunches and snacking", (("flavor", ("original", "tropical", "chocolate", "honey roasted", "salted")), ("size", FOOD_SIZES))),
    _t("gummy candy", "candy gummies gummy bears", "grocery & gourmet food › candy › gummies", "food", "fruit snacks, vegan, sour, bulk", "fat free, party favor, individually wrapped", (5, 25), "for parties, movie nights and treats", (("flavor", CANDY_FLAVORS), ("size", FOOD_SIZES))),
    _t("olive oil", "oil olive", "grocery & gourmet food › pantry › oils", "food", "extra virgin, cold pressed, italian, greek", "first cold press, rich flavor", (9, 45), "for cooking, dressings and dipping", (("size", ("16.9 fl oz", "25.3 fl oz", "33.8 fl oz", "3 liter")),)),
    _t("raw honey", "honey jar", "grocery & gourmet food › pantry › honey", "food", "manuka, wildflower, clover, unfiltered", "pure honey, unpasteurized", (7, 39), "for tea, baking and breakfast", (("size", FOOD_SIZES), ("pack", ("1 pack", "2 pack", "3 pack")))),
    # sports & outdoors
    _t("yoga mat", "mat mats", "sports & outdoors › exercise & fitness › yoga", "fitness", "thick, extra wide, tpe, cork", "carrying strap, double sided", (15, 69), "for yoga, pilates and floor workouts", (("color", COLORS), ("size", ("1/4 inch", "1/3 inch", "1/2 inch")))),
    _t("resistance bands", "bands band loop tubes", "sports & outdoors › exercise & fitness › bands", "fitness", "fabric, loop, tube, pull up", "door anchor, five levels", (9, 35), "for strength training, physical therapy and stretching"),
    _t("dumbbells", "dumbbells dumbbell weights", "sports & outdoors › exercise & fitness › weights", "fitness", "adjustable, neoprene, hex, rubber", "anti roll, comfortable grip", (19, 199), "for home gym strength training", (("weight", WEIGHTS), ("color", COLORS))),
    _t("water bottle", "bottle flask", "sports & outdoors › outdoor recreation › hydration", "drinkware", "insulated, sports, kids, motivational", "straw lid, wide mouth", (9, 45), "for the gym, school, hiking and the office"),
    _t("travel mug", "mug tumbler cup", "home & kitchen › kitchen & dining › drinkware", "drinkware", "insulated, coffee, ceramic, handle", "spill proof, sliding lid", (9, 39), "for coffee and tea on the go"),
    _t("camping tent", "tent shelter", "sports & outdoors › outdoor recreation › camping", "camping", "dome, instant, backpacking, family", "rain fly, mesh windows", (39, 249), "for camping, festivals and backpacking trips"),
    _t("sleeping bag", "bag sleeping", "sports & outdoors › outdoor recreation › camping", "camping", "mummy, cold weather, kids, double", "compression sack, three season", (24, 129), "for camping, sleepovers and backpacking", (("color", COLORS), ("size", ("regular", "long", "kids")))),
    _t("hiking backpack", "backpack bag daypack", "sports & outdoors › outdoor recreation › backpacks", "camping", "40l, daypack, hydration, rolltop", "rain cover, padded straps", (25, 119), "for hiking, travel and day trips", (("color", COLORS), ("capacity", ("20 liter", "30 liter", "40 liter", "50 liter")))),
    _t("bike light", "light lights lamp", "sports & outdoors › cycling › lights", "accessory", "front, rear, tail, led", "easy install, multiple modes, usb rechargeable", (9, 45), "for night riding and commuting"),
    # pet supplies
    _t("dog bed", "bed cushion", "pet supplies › dogs › beds", "pet_gear", "bolster, calming, memory foam, donut", "removable cover, waterproof lining, orthopedic", (19, 99), "for dogs of every size to rest"),
    _t("cat tree", "tree tower condo", "pet supplies › cats › furniture", "pet_gear", "multi level, sisal, small, large", "scratching posts, stable base", (29, 149), "for cats to climb, scratch and nap", (("color", ("beige", "grey", "dark grey", "brown", "white")), ("size", ("small", "medium", "large")))),
    _t("dog leash", "leash lead rope", "pet supplies › dogs › collars & leashes", "pet_gear", "retractable, reflective, nylon, rope", "padded handle, sturdy clip", (8, 35), "for daily walks and training"),
    _t("dog treats", "treats chews snacks", "pet supplies › dogs › treats", "pet_care", "training, dental, jerky, soft", "high protein, grain free, single ingredient", (6, 32), "for training and rewarding dogs", (("flavor", PET_FLAVORS), ("size", FOOD_SIZES))),
    _t("pet shampoo", "shampoo wash", "pet supplies › grooming › shampoo", "pet_care", "oatmeal, flea, puppy, deodorizing", "sensitive skin, tear free, paraben free", (7, 29), "for bathing dogs and cats", (("scent", SCENTS), ("size", FLUID_SIZES))),
    _t("cat litter", "litter", "pet supplies › cats › litter", "pet_care", "multi cat, unscented, clay, tofu", "odor control, low dust, clumping", (9, 39), "for clean, fresh litter boxes", (("size", ("10 pound", "20 pound", "25 pound", "40 pound")), ("scent", ("unscented", "lavender", "fresh linen", "citrus")))),
    # health & household
    _t("vitamin d3 supplement", "supplement vitamin softgels", "health & household › vitamins › vitamin d", "supplement", "5000 iu, 2000 iu, with k2, softgels", "immune support, bone health", (7, 29), "for daily immune and bone support"),
    _t("fish oil", "oil omega softgels supplement", "health & household › vitamins › omega", "supplement", "omega 3, triple strength, lemon, burpless", "heart health, brain support", (9, 39), "for heart, brain and joint health"),
    _t("hand sanitizer", "sanitizer gel hand", "health & household › health care › sanitizers", "household", "gel, spray, aloe, travel", "kills germs, moisturizing, travel size, fragrance free", (4, 25), "for clean hands at home and on the go"),
    _t("laundry detergent", "detergent laundry pods", "health & household › household supplies › laundry", "household", "liquid, pods, free and clear, he", "stain removal, cold water, fragrance free, plant based", (8, 35), "for fresh, clean laundry"),
    _t("trash bags", "bags bag garbage", "health & household › household supplies › trash bags", "household", "13 gallon, drawstring, kitchen, outdoor", "tear resistant, leak proof, odor control", (9, 32), "for the kitchen, bathroom and yard", (("pack", ("30 count", "50 count", "90 count", "120 count")), ("scent", ("unscented", "lavender", "fresh linen", "citrus")))),
    _t("paper towels", "towels paper rolls", "health & household › household supplies › paper", "household", "select a size, double rolls, family rolls, strong", "absorbent, two ply, plant based", (9, 39), "for spills, cleaning and kitchens", (("pack", ("6 pack", "8 pack", "12 pack")),)),
    # office products
    _t("gel pens", "pens pen ink", "office products › writing › pens", "office", "fine point, retractable, colored, black ink", "no smudge, comfortable grip, smooth writing, quick drying, refillable", (5, 24), "for journaling, school and the office"),
    _t("spiral notebook", "notebook notebooks journal", "office products › paper › notebooks", "office", "college ruled, wide ruled, hardcover, dotted", "thick paper, perforated pages, acid free", (5, 25), "for school, notes and planning"),
    _t("desk organizer", "organizer tray holder", "office products › desk accessories › organizers", "office", "mesh, wooden, drawer, rotating", "multiple compartments, space saving", (9, 39), "for pens, files and office supplies"),
    _t("office chair", "chair seat", "office products › furniture › chairs", "furniture", "ergonomic, mesh, executive, gaming", "lumbar support, adjustable height, breathable mesh, swivel wheels", (59, 299), "for the home office and long work days", (("color", ("black", "grey", "white", "blue", "pink", "brown")),)),
    # furniture
    _t("bookshelf", "bookshelf bookcase shelf shelves", "home & kitchen › furniture › bookcases", "furniture", "5 tier, ladder, industrial, corner", "open shelves, anti tip, solid wood, storage space, living room", (39, 199), "for books, plants and decor"),
    _t("tv stand", "stand console cabinet", "home & kitchen › furniture › tv stands", "furniture", "farmhouse, corner, floating, 65 inch", "cable management, adjustable shelves, storage space, living room, engineered wood", (59, 299), "for tvs, media players and game consoles"),
    _t("nightstand", "nightstand table drawer", "home & kitchen › furniture › nightstands", "furniture", "2 drawer, rattan, small, modern", "charging station, storage space, bedroom, solid wood", (29, 149), "for beside the bed"),
    _t("bar stools", "stools stool chairs", "home & kitchen › furniture › stools", "furniture", "counter height, swivel, upholstered, metal", "footrest, backrest", (49, 249), "for kitchen islands and home bars", (("color", WOOD_FINISHES), ("pack", ("1 pack", "2 pack", "4 pack")))),
    # toys & games
    _t("jigsaw puzzle", "puzzle puzzles pieces", "toys & games › puzzles › jigsaw", "toy", "1000 piece, 500 piece, landscape, animal", "thick pieces, poster included", (9, 29), "for family game night and relaxing"),
    _t("building blocks", "blocks bricks set", "toys & games › building toys › blocks", "toy", "magnetic, classic, large, stem", "compatible with major brands, storage box", (15, 79), "for creative play and stem learning"),
    _t("plush toy", "toy plush stuffed animal", "toys & games › stuffed animals › plush", "toy", "teddy bear, unicorn, dinosaur, giant", "soft material, huggable", (9, 49), "for kids, nurseries and gifts", (("color", COLORS), ("size", ("8 inch", "12 inch", "18 inch", "24 inch")))),
    # tools & home improvement
    _t("cordless drill", "drill driver", "tools & home improvement › power tools › drills", "tool", "20v, brushless, compact, hammer", "led light, two batteries, cordless, rechargeable battery", (39, 179), "for drilling, driving screws and home projects"),
    _t("led light bulbs", "bulbs bulb light lights", "tools & home improvement › lighting › bulbs", "tool", "a19, smart, daylight, soft white", "energy saving, 60 watt equivalent, dimmable", (8, 39), "for lamps, ceilings and fixtures", (("pack", ("4 pack", "6 pack", "12 pack", "24 pack")),)),
    _t("tool set", "set tools kit toolbox", "tools & home improvement › hand tools › sets", "tool", "mechanics, household, 100 piece, socket", "storage case, chrome vanadium", (25, 149), "for home repairs and diy projects"),
)

NOUN_LEXICON: frozenset[str] = frozenset(
    word for product_type in PRODUCT_TYPES for word in product_type.nouns
)
"""Words counted as nouns when the reward compares titles (brands never are)."""

_SYLLABLES = ("ka", "lo", "vi", "ra", "ne", "to", "mi", "zu", "sa", "be", "do", "fi",
              "qu", "ri", "xo", "le", "ma", "no", "pe", "su", "ty", "va", "wo", "ze")
_ENDINGS = ("", "x", "n", "ra", "ly", "co", "tek", "on", "ia", "ex")
_REVIEW_TITLES = ("Great value", "Works as described", "Love it", "Would buy again", "Pretty good",
                  "Not bad for the price", "Exactly what I needed", "Smaller than expected", "Solid quality")
_REVIEW_BODIES = ("I use this {name} every day and it holds up well.",
                  "The {name} arrived quickly and looks like the pictures.",
                  "Good {name} overall, though the packaging could be better.",
                  "Bought this {name} as a gift and they loved it.",
                  "Does the job. I would recommend this {name} to friends.")
_FEATURE_TEMPLATES = ("{ATTR} - this {name} is {attr}, made {use}.",
                      "{ATTR}: designed to be {attr} so it keeps up with daily use.",
                      "{ATTR} DESIGN - a {attr} {name} you can rely on.")


@dataclass(frozen=True)
class Product:
    """One product of the shop, as WebShop's product records describe it.

    ``query`` is the product type's search phrase (WebShop's scraping query);
    ``category`` is a ``" › "``-joined path; ``options`` maps each option group
    to the values offered, in display order.
    """

    asin: str
    title: str
    query: str
    category: str
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]]
    price: float
    description: str
    features: tuple[str, ...]
    reviews: tuple[tuple[str, int, str], ...]  # (title, score 1-5, body)
    qualifier: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Product":
        return cls(
            asin=data["asin"], title=data["title"], query=data["query"], category=data["category"],
            attributes=tuple(data["attributes"]),
            options={group: tuple(values) for group, values in data["options"].items()},
            price=float(data["price"]), description=data["description"],
            features=tuple(data["features"]),
            reviews=tuple((t, int(s), b) for t, s, b in data["reviews"]),
            qualifier=data.get("qualifier", ""),
        )


def spec_fingerprint() -> str:
    """A short digest of the generator's vocabulary: a changed table means a new catalogue."""
    text = repr((CATALOG_VERSION, FAMILIES, PRODUCT_TYPES, _SYLLABLES, _ENDINGS,
                 _REVIEW_TITLES, _REVIEW_BODIES, _FEATURE_TEMPLATES))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_catalog(seed: int = 0, products_per_type: tuple[int, int] = (24, 36)) -> list[Product]:
    """Generate the whole catalogue from ``seed`` (same seed, same products, any machine)."""
    rng = random.Random(seed * 1_000_003 + 7)
    brands = _brand_names(rng, 160)
    used_asins: set[str] = set()
    products: list[Product] = []
    for product_type in PRODUCT_TYPES:
        count = rng.randint(*products_per_type)
        for _ in range(count):
            asin = _new_asin(rng, used_asins)
            products.append(_make_product(rng, product_type, asin, rng.choice(brands)))
    return products


def _brand_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        stem = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
        name = (stem + rng.choice(_ENDINGS)).capitalize()
        if name not in names:
            names.append(name)
    return names


def _new_asin(rng: random.Random, used: set[str]) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    while True:
        asin = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if asin not in used:
            used.add(asin)
            return asin


def type_attributes(product_type: ProductType) -> tuple[str, ...]:
    """All attributes a product of ``product_type`` may have (type first, then family)."""
    family_attributes = FAMILIES[product_type.family][0]
    merged = list(product_type.attributes)
    merged += [a for a in family_attributes if a not in merged]
    return tuple(merged)


def type_option_groups(product_type: ProductType) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The option groups of ``product_type``: its own, else its family's."""
    return product_type.options or FAMILIES[product_type.family][1]


def _make_product(rng: random.Random, product_type: ProductType, asin: str, brand: str) -> Product:
    attributes = tuple(rng.sample(type_attributes(product_type), rng.randint(3, 5)))
    options = _choose_options(rng, type_option_groups(product_type))
    qualifier = rng.choice(product_type.qualifiers) if product_type.qualifiers else ""
    low, high = product_type.price
    price = round(rng.uniform(low, high)) - rng.choice((0.01, 0.01, 0.05, 0.51))
    price = max(round(price, 2), 1.99)
    return Product(
        asin=asin,
        title=_title(rng, product_type, brand, qualifier, attributes),
        query=product_type.name,
        category=" › ".join(product_type.category),
        attributes=attributes,
        options=options,
        price=price,
        description=_description(rng, product_type, brand, qualifier, attributes),
        features=_features(rng, product_type, attributes),
        reviews=_reviews(rng, product_type),
        qualifier=qualifier,
    )


def _choose_options(rng: random.Random, groups) -> dict[str, tuple[str, ...]]:
    """Offered values per group; the last group may be dropped; values never repeat across groups."""
    chosen: dict[str, tuple[str, ...]] = {}
    taken: set[str] = set()
    for index, (group, values) in enumerate(groups):
        if index > 0 and rng.random() < 0.15:
            continue
        available = [v for v in values if v not in taken]
        if len(available) < 2:
            continue
        size = rng.randint(2, min(6, len(available)))
        if group in ("size", "length", "capacity", "weight", "count"):
            start = rng.randint(0, len(available) - size)  # sizes come in a contiguous run
            picked = available[start:start + size]
        else:
            picked = sorted(rng.sample(available, size), key=available.index)
        chosen[group] = tuple(picked)
        taken.update(picked)
    return chosen


def _title_case(text: str) -> str:
    return " ".join(word if any(c.isdigit() for c in word) else word[:1].upper() + word[1:]
                    for word in text.split())


def _title(rng, product_type: ProductType, brand: str, qualifier: str, attributes) -> str:
    in_title = list(attributes[: rng.randint(1, 2)])
    shown = set(product_type.name.split()) | set(qualifier.split())
    extra_nouns = [n for n in product_type.nouns if n not in shown]
    head = f"{brand} {qualifier} {in_title[0]} {product_type.name}".split()
    title = _title_case(" ".join(head))
    tail = in_title[1:] + ([rng.choice(extra_nouns)] if extra_nouns and rng.random() < 0.6 else [])
    if tail:
        title += ", " + _title_case(" ".join(tail))
    return title


def _description(rng, product_type: ProductType, brand: str, qualifier: str, attributes) -> str:
    opening = rng.choice((
        f"The {brand} {qualifier} {product_type.name} is made {product_type.use}.",
        f"Meet the {qualifier} {product_type.name} from {brand}, made {product_type.use}.",
        f"{brand} designs every {product_type.name} {product_type.use}.",
    ))
    listed = ", ".join(attributes[:-1]) + f" and {attributes[-1]}"
    middle = f"It is {listed}."
    closing = rng.choice(("Backed by a one year warranty.", "Ships in recyclable packaging.",
                          "A thoughtful gift for friends and family.", ""))
    return " ".join(" ".join(part.split()) for part in (opening, middle, closing) if part)


def _features(rng, product_type: ProductType, attributes) -> tuple[str, ...]:
    bullets = []
    for attribute in attributes:
        # "{ATTR} DESIGN" would stutter after an attribute that already ends in "design"
        templates = _FEATURE_TEMPLATES[:2] if attribute.endswith("design") else _FEATURE_TEMPLATES
        template = rng.choice(templates)
        bullets.append(template.format(ATTR=attribute.upper(), attr=attribute,
                                       name=product_type.name, use=product_type.use))
    bullets.append(f"WHAT YOU GET - one {product_type.name} and our friendly customer service.")
    return tuple(bullets)


def _reviews(rng, product_type: ProductType) -> tuple[tuple[str, int, str], ...]:
    return tuple(
        (rng.choice(_REVIEW_TITLES), rng.randint(3, 5), rng.choice(_REVIEW_BODIES).format(name=product_type.name))
        for _ in range(rng.randint(0, 3))
    )
