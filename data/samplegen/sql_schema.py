"""A small fixed company schema, filled with deterministic rows, for checking SQL answers."""
from __future__ import annotations

import random
import sqlite3

TABLES = {
    "departments": "id INTEGER PRIMARY KEY, name TEXT NOT NULL, location TEXT NOT NULL, budget INTEGER NOT NULL",
    "employees": ("id INTEGER PRIMARY KEY, name TEXT NOT NULL, department_id INTEGER REFERENCES departments(id), "
                  "manager_id INTEGER REFERENCES employees(id), title TEXT NOT NULL, salary INTEGER NOT NULL, "
                  "hire_date TEXT NOT NULL"),
    "customers": "id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL, country TEXT NOT NULL, signup_date TEXT NOT NULL",
    "products": "id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price REAL NOT NULL",
    "orders": ("id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id), "
               "employee_id INTEGER REFERENCES employees(id), order_date TEXT NOT NULL, status TEXT NOT NULL"),
    "order_items": ("order_id INTEGER NOT NULL REFERENCES orders(id), product_id INTEGER NOT NULL REFERENCES products(id), "
                    "quantity INTEGER NOT NULL, unit_price REAL NOT NULL"),
}

DEPARTMENTS = [("Engineering", "Berlin", 1_400_000), ("Sales", "London", 600_000), ("Marketing", "London", 350_000),
               ("Finance", "New York", 500_000), ("Support", "Lisbon", 300_000), ("Research", "Berlin", 900_000),
               ("Operations", "Toronto", 420_000), ("Legal", "New York", 250_000)]
TITLES = {"Engineering": ["Engineer", "Senior Engineer", "Staff Engineer"], "Sales": ["Account Executive", "Sales Manager"],
          "Marketing": ["Marketing Specialist", "Content Writer"], "Finance": ["Accountant", "Financial Analyst"],
          "Support": ["Support Agent", "Support Lead"], "Research": ["Research Scientist", "Data Scientist"],
          "Operations": ["Operations Analyst", "Logistics Coordinator"], "Legal": ["Counsel", "Paralegal"]}
FIRST = ["Ada", "Alan", "Grace", "Linus", "Margaret", "Dennis", "Barbara", "Ken", "Frances", "Edsger", "Radia",
         "Donald", "Hedy", "John", "Karen", "Niklaus", "Sophie", "Tim", "Yukihiro", "Guido", "Anita", "Bjarne"]
LAST = ["Lovelace", "Turing", "Hopper", "Torvalds", "Hamilton", "Ritchie", "Liskov", "Thompson", "Allen", "Dijkstra",
        "Perlman", "Knuth", "Lamarr", "Backus", "Jones", "Wirth", "Wilson", "Berners", "Matsumoto", "Rossum", "Borg"]
CITIES = [("London", "UK"), ("Manchester", "UK"), ("Paris", "France"), ("Lyon", "France"), ("Berlin", "Germany"),
          ("Munich", "Germany"), ("Madrid", "Spain"), ("Lisbon", "Portugal"), ("Toronto", "Canada"),
          ("Boston", "USA"), ("Chicago", "USA"), ("Osaka", "Japan")]
PRODUCTS = {"Books": ["SQL Pocket Guide", "Python Cookbook", "Graph Theory Notes", "Poetry Anthology", "World Atlas"],
            "Electronics": ["USB-C Cable", "Wireless Mouse", "Mechanical Keyboard", "Headphones", "Webcam", "Monitor"],
            "Garden": ["Watering Can", "Pruning Shears", "Seed Kit", "Garden Hose"],
            "Toys": ["Puzzle Cube", "Building Blocks", "Kite", "Board Game"],
            "Kitchen": ["Chef Knife", "Cast Iron Pan", "Coffee Grinder", "Teapot", "Cutting Board"],
            "Sports": ["Yoga Mat", "Tennis Racket", "Running Shoes", "Water Bottle", "Jump Rope"]}
STATUSES = ["pending", "shipped", "delivered", "delivered", "delivered", "cancelled"]
YEARS = [2021, 2022, 2023, 2024]


def schema_lines(tables: tuple[str, ...]) -> str:
    """One `name(col, col, ...)` line per table, the way prompts show the schema."""
    lines = []
    for table in tables:
        columns = [part.strip().split()[0] for part in TABLES[table].split(",")]
        lines.append(f"{table}({', '.join(columns)})")
    return "\n".join(lines)


def build_database() -> sqlite3.Connection:
    """An in-memory database with the schema and a fixed, seeded population."""
    conn = sqlite3.connect(":memory:")
    for name, columns in TABLES.items():
        conn.execute(f"CREATE TABLE {name} ({columns})")
    rng = random.Random(20240601)
    _fill_staff(conn, rng)
    _fill_shop(conn, rng)
    conn.commit()
    return conn


def _fill_staff(conn: sqlite3.Connection, rng: random.Random) -> None:
    conn.executemany("INSERT INTO departments VALUES (?, ?, ?, ?)",
                     [(i, n, loc, b) for i, (n, loc, b) in enumerate(DEPARTMENTS, 1)])
    emp_id = 0
    for dept_id, (dept, _, _) in enumerate(DEPARTMENTS, 1):
        head = None
        for k in range(rng.randint(5, 10)):
            emp_id += 1
            name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
            title = f"Head of {dept}" if k == 0 else rng.choice(TITLES[dept])
            salary = rng.randrange(95_000 if k == 0 else 42_000, 160_000 if k == 0 else 120_000, 500)
            hired = f"{rng.randint(2014, 2024)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            conn.execute("INSERT INTO employees VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (emp_id, name, dept_id, head, title, salary, hired))
            head = head or emp_id


def _fill_shop(conn: sqlite3.Connection, rng: random.Random) -> None:
    for cid in range(1, 91):
        city, country = rng.choice(CITIES)
        signup = f"{rng.choice(YEARS)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        conn.execute("INSERT INTO customers VALUES (?, ?, ?, ?, ?)",
                     (cid, f"{rng.choice(FIRST)} {rng.choice(LAST)}", city, country, signup))
    pid = 0
    for category, names in PRODUCTS.items():
        for name in names:
            pid += 1
            conn.execute("INSERT INTO products VALUES (?, ?, ?, ?)", (pid, name, category, rng.randrange(300, 25_000) / 100))
    prices = dict(conn.execute("SELECT id, price FROM products"))
    ordered = list(prices)[:-4]  # the last few products are never ordered
    sales_staff = [r[0] for r in conn.execute("SELECT id FROM employees WHERE department_id IN (2, 5)")]
    for oid in range(1, 701):
        customer = rng.randint(1, 80)  # customers 81-90 never order
        date = f"{rng.choice(YEARS)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        conn.execute("INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
                     (oid, customer, rng.choice(sales_staff), date, rng.choice(STATUSES)))
        for product in rng.sample(ordered, rng.randint(1, 4)):
            conn.execute("INSERT INTO order_items VALUES (?, ?, ?, ?)",
                         (oid, product, rng.randint(1, 5), prices[product]))
