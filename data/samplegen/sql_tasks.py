"""SQL question templates over the fixed schema; every answer is run on sqlite3 and must return rows."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

from .sql_schema import CITIES, DEPARTMENTS, PRODUCTS, TITLES, YEARS, build_database, schema_lines

DEPTS = [d[0] for d in DEPARTMENTS]
COUNTRIES = sorted({c for _, c in CITIES})
CATEGORIES = list(PRODUCTS)
EMP = ("employees", "departments")
SHOP = ("customers", "orders", "order_items", "products")


@dataclass(frozen=True)
class SqlTask:
    template: str
    question: str
    sql: str
    tables: tuple[str, ...]


Template = Callable[[], Iterator[tuple[str, str, tuple[str, ...]]]]


def _employees_in_department():
    for d in DEPTS:
        yield (f"List the names and salaries of the employees in the {d} department, highest salary first.",
               f"SELECT e.name, e.salary\nFROM employees AS e\nJOIN departments AS d ON d.id = e.department_id\n"
               f"WHERE d.name = '{d}'\nORDER BY e.salary DESC;", EMP)


def _headcount_over():
    for n in (4, 5, 6, 7, 8):
        yield (f"Which departments have more than {n} employees? Show the department name and its headcount.",
               f"SELECT d.name, COUNT(*) AS headcount\nFROM departments AS d\nJOIN employees AS e ON e.department_id = d.id\n"
               f"GROUP BY d.id, d.name\nHAVING COUNT(*) > {n}\nORDER BY headcount DESC;", EMP)


def _average_salary_by_location():
    for loc in sorted({d[1] for d in DEPARTMENTS}):
        yield (f"What is the average salary of employees working in departments located in {loc}? Round to whole units.",
               f"SELECT ROUND(AVG(e.salary)) AS average_salary\nFROM employees AS e\n"
               f"JOIN departments AS d ON d.id = e.department_id\nWHERE d.location = '{loc}';", EMP)


def _top_earners():
    for k, d in itertools.product((2, 3), DEPTS):
        yield (f"Show the {k} best-paid employees of the {d} department with their titles.",
               f"SELECT e.name, e.title, e.salary\nFROM employees AS e\nJOIN departments AS d ON d.id = e.department_id\n"
               f"WHERE d.name = '{d}'\nORDER BY e.salary DESC\nLIMIT {k};", EMP)


def _hired_in_year():
    for y in range(2015, 2025):
        yield (f"Which employees were hired in {y}? Give name and hire date, earliest first.",
               f"SELECT name, hire_date\nFROM employees\nWHERE strftime('%Y', hire_date) = '{y}'\nORDER BY hire_date;",
               ("employees",))


def _salary_above():
    for s in (60_000, 80_000, 100_000):
        for d in DEPTS[:5]:
            yield (f"List employees in {d} who earn more than {s}.",
                   f"SELECT e.name, e.salary\nFROM employees AS e\nJOIN departments AS d ON d.id = e.department_id\n"
                   f"WHERE d.name = '{d}' AND e.salary > {s}\nORDER BY e.salary DESC;", EMP)


def _direct_reports():
    for n in (3, 5, 7):
        yield (f"Find managers with at least {n} direct reports, with the number of reports.",
               f"SELECT m.name AS manager, COUNT(e.id) AS reports\nFROM employees AS m\n"
               f"JOIN employees AS e ON e.manager_id = m.id\nGROUP BY m.id, m.name\nHAVING COUNT(e.id) >= {n}\n"
               "ORDER BY reports DESC;", ("employees",))


def _above_department_average():
    for d in DEPTS:
        yield (f"Which employees of {d} earn more than the average salary of their own department?",
               "SELECT e.name, e.salary\nFROM employees AS e\nJOIN departments AS d ON d.id = e.department_id\n"
               f"WHERE d.name = '{d}'\n  AND e.salary > (SELECT AVG(x.salary) FROM employees AS x\n"
               "                  WHERE x.department_id = e.department_id);", EMP)


def _second_highest_salary():
    for d in DEPTS:
        yield (f"What is the second highest distinct salary in the {d} department?",
               "SELECT DISTINCT e.salary\nFROM employees AS e\nJOIN departments AS d ON d.id = e.department_id\n"
               f"WHERE d.name = '{d}'\nORDER BY e.salary DESC\nLIMIT 1 OFFSET 1;", EMP)


def _top_per_department():
    for k in (1, 2, 3):
        yield (f"For every department, list its top {k} earner(s) using a window function.",
               "SELECT department, name, salary\nFROM (\n  SELECT d.name AS department, e.name, e.salary,\n"
               "         RANK() OVER (PARTITION BY d.id ORDER BY e.salary DESC) AS salary_rank\n"
               "  FROM employees AS e\n  JOIN departments AS d ON d.id = e.department_id\n) AS ranked\n"
               f"WHERE salary_rank <= {k}\nORDER BY department, salary DESC;", EMP)


def _customers_in_city():
    for city, _ in CITIES:
        yield (f"List the customers who live in {city}, in alphabetical order.",
               f"SELECT name\nFROM customers\nWHERE city = '{city}'\nORDER BY name;", ("customers",))


def _customers_without_orders():
    yield ("Which customers have never placed an order?",
           "SELECT c.name\nFROM customers AS c\nLEFT JOIN orders AS o ON o.customer_id = c.id\n"
           "WHERE o.id IS NULL\nORDER BY c.name;", ("customers", "orders"))
    for country in COUNTRIES:
        yield (f"Which customers from {country} have never placed an order?",
               "SELECT c.name\nFROM customers AS c\nWHERE c.country = '{0}'\n  AND NOT EXISTS (SELECT 1 FROM orders AS o "
               "WHERE o.customer_id = c.id);".format(country), ("customers", "orders"))


def _orders_per_customer():
    for country, k in itertools.product(COUNTRIES, (3, 5)):
        yield (f"Show the {k} customers from {country} with the most orders, and their order counts.",
               "SELECT c.name, COUNT(o.id) AS order_count\nFROM customers AS c\nJOIN orders AS o ON o.customer_id = c.id\n"
               f"WHERE c.country = '{country}'\nGROUP BY c.id, c.name\nORDER BY order_count DESC, c.name\nLIMIT {k};",
               ("customers", "orders"))


def _revenue_by_category():
    for y in YEARS:
        yield (f"What was the revenue per product category in {y}, excluding cancelled orders? Largest first.",
               "SELECT p.category, ROUND(SUM(oi.quantity * oi.unit_price), 2) AS revenue\nFROM order_items AS oi\n"
               "JOIN orders AS o ON o.id = oi.order_id\nJOIN products AS p ON p.id = oi.product_id\n"
               f"WHERE strftime('%Y', o.order_date) = '{y}' AND o.status <> 'cancelled'\nGROUP BY p.category\n"
               "ORDER BY revenue DESC;", ("orders", "order_items", "products"))


def _orders_per_month():
    for y, status in itertools.product(YEARS, ("delivered", "cancelled", "pending")):
        yield (f"How many {status} orders were placed in each month of {y}?",
               "SELECT strftime('%m', order_date) AS month, COUNT(*) AS orders\nFROM orders\n"
               f"WHERE strftime('%Y', order_date) = '{y}' AND status = '{status}'\nGROUP BY month\nORDER BY month;",
               ("orders",))


def _products_in_price_range():
    for lo, hi in ((5, 50), (20, 100), (50, 150), (100, 250)):
        for cat in CATEGORIES[:4]:
            yield (f"List {cat} products priced between {lo} and {hi}, cheapest first.",
                   f"SELECT name, price\nFROM products\nWHERE category = '{cat}' AND price BETWEEN {lo} AND {hi}\n"
                   "ORDER BY price;", ("products",))


def _best_seller_in_category():
    for cat, y in itertools.product(CATEGORIES, YEARS):
        yield (f"Which {cat} product sold the most units in {y}?",
               "SELECT p.name, SUM(oi.quantity) AS units\nFROM order_items AS oi\nJOIN products AS p ON p.id = oi.product_id\n"
               "JOIN orders AS o ON o.id = oi.order_id\n"
               f"WHERE p.category = '{cat}' AND strftime('%Y', o.order_date) = '{y}'\nGROUP BY p.id, p.name\n"
               "ORDER BY units DESC\nLIMIT 1;", ("orders", "order_items", "products"))


def _big_spenders():
    for total in (500, 1000, 2000, 3000):
        yield (f"Which customers have spent more than {total} in total on delivered orders?",
               "SELECT c.name, ROUND(SUM(oi.quantity * oi.unit_price), 2) AS spent\nFROM customers AS c\n"
               "JOIN orders AS o ON o.customer_id = c.id\nJOIN order_items AS oi ON oi.order_id = o.id\n"
               f"WHERE o.status = 'delivered'\nGROUP BY c.id, c.name\nHAVING SUM(oi.quantity * oi.unit_price) > {total}\n"
               "ORDER BY spent DESC;", SHOP[:3])


def _revenue_by_sales_rep():
    for y in YEARS:
        yield (f"Rank the employees who handled orders in {y} by the revenue of those orders.",
               "SELECT e.name, ROUND(SUM(oi.quantity * oi.unit_price), 2) AS revenue\nFROM employees AS e\n"
               "JOIN orders AS o ON o.employee_id = e.id\nJOIN order_items AS oi ON oi.order_id = o.id\n"
               f"WHERE strftime('%Y', o.order_date) = '{y}'\nGROUP BY e.id, e.name\nORDER BY revenue DESC;",
               ("employees", "orders", "order_items"))


def _never_ordered_products():
    yield ("Which products have never been ordered?",
           "SELECT p.name\nFROM products AS p\nWHERE NOT EXISTS (SELECT 1 FROM order_items AS oi WHERE oi.product_id = p.id);",
           ("products", "order_items"))


def _running_revenue():
    for y, m in itertools.product(YEARS, (1, 4, 7, 10)):
        yield (f"Show the daily revenue and its running total for {y}-{m:02d}.",
               "SELECT o.order_date, SUM(oi.quantity * oi.unit_price) AS revenue,\n"
               "       SUM(SUM(oi.quantity * oi.unit_price)) OVER (ORDER BY o.order_date) AS running_total\n"
               "FROM orders AS o\nJOIN order_items AS oi ON oi.order_id = o.id\n"
               f"WHERE strftime('%Y-%m', o.order_date) = '{y}-{m:02d}'\nGROUP BY o.order_date\nORDER BY o.order_date;",
               ("orders", "order_items"))


def _payroll_vs_budget():
    for share in (50, 75, 100):
        yield (f"Which departments spend more than {share}% of their budget on salaries?",
               "SELECT d.name, SUM(e.salary) AS payroll, d.budget\nFROM departments AS d\n"
               "JOIN employees AS e ON e.department_id = d.id\nGROUP BY d.id, d.name, d.budget\n"
               f"HAVING SUM(e.salary) > d.budget * {share} / 100.0\nORDER BY payroll DESC;", EMP)


def _latest_order_per_customer():
    for country in COUNTRIES:
        yield (f"For each customer in {country}, show the date of their most recent order.",
               "SELECT c.name, MAX(o.order_date) AS last_order\nFROM customers AS c\nJOIN orders AS o ON o.customer_id = c.id\n"
               f"WHERE c.country = '{country}'\nGROUP BY c.id, c.name\nORDER BY last_order DESC;", ("customers", "orders"))


def _cancellation_rate():
    for country in COUNTRIES:
        yield (f"What percentage of orders from customers in {country} were cancelled, per year?",
               "SELECT strftime('%Y', o.order_date) AS year,\n"
               "       ROUND(100.0 * SUM(CASE WHEN o.status = 'cancelled' THEN 1 ELSE 0 END) / COUNT(*), 1) AS cancelled_pct\n"
               "FROM orders AS o\nJOIN customers AS c ON c.id = o.customer_id\n"
               f"WHERE c.country = '{country}'\nGROUP BY year\nORDER BY year;", ("customers", "orders"))


def _cities_buying_category():
    for cat in CATEGORIES:
        yield (f"In which cities do customers buy {cat} products?",
               "SELECT DISTINCT c.city\nFROM customers AS c\nJOIN orders AS o ON o.customer_id = c.id\n"
               "JOIN order_items AS oi ON oi.order_id = o.id\nJOIN products AS p ON p.id = oi.product_id\n"
               f"WHERE p.category = '{cat}'\nORDER BY c.city;", SHOP)


def _signup_year_buyers():
    for y in YEARS:
        yield (f"Which customers who signed up in {y} also placed an order in {y}?",
               "SELECT c.name\nFROM customers AS c\n"
               f"WHERE strftime('%Y', c.signup_date) = '{y}'\n  AND EXISTS (SELECT 1 FROM orders AS o\n"
               f"              WHERE o.customer_id = c.id AND strftime('%Y', o.order_date) = '{y}')\nORDER BY c.name;",
               ("customers", "orders"))


def _year_over_year():
    for cat in CATEGORIES:
        yield (f"Show yearly revenue for {cat} products and the change from the previous year.",
               "WITH yearly AS (\n  SELECT strftime('%Y', o.order_date) AS year, SUM(oi.quantity * oi.unit_price) AS revenue\n"
               "  FROM orders AS o\n  JOIN order_items AS oi ON oi.order_id = o.id\n"
               "  JOIN products AS p ON p.id = oi.product_id\n"
               f"  WHERE p.category = '{cat}'\n  GROUP BY year\n)\n"
               "SELECT year, ROUND(revenue, 2) AS revenue,\n       ROUND(revenue - LAG(revenue) OVER (ORDER BY year), 2) AS change\n"
               "FROM yearly\nORDER BY year;", ("orders", "order_items", "products"))


def _average_order_value():
    for y in YEARS:
        yield (f"What was the average order value per customer country in {y}?",
               "WITH order_totals AS (\n  SELECT o.id, c.country, SUM(oi.quantity * oi.unit_price) AS total\n"
               "  FROM orders AS o\n  JOIN customers AS c ON c.id = o.customer_id\n"
               "  JOIN order_items AS oi ON oi.order_id = o.id\n"
               f"  WHERE strftime('%Y', o.order_date) = '{y}'\n  GROUP BY o.id, c.country\n)\n"
               "SELECT country, ROUND(AVG(total), 2) AS average_order_value\nFROM order_totals\nGROUP BY country\n"
               "ORDER BY average_order_value DESC;", SHOP[:3])


def _hired_since_in_department():
    for d, y in itertools.product(DEPTS, (2018, 2021)):
        yield (f"Which {d} employees were hired on or after January 1st, {y}?",
               "SELECT e.name, e.hire_date\nFROM employees AS e\nJOIN departments AS d ON d.id = e.department_id\n"
               f"WHERE d.name = '{d}' AND e.hire_date >= '{y}-01-01'\nORDER BY e.hire_date;", EMP)


def _employees_with_title():
    for title in sorted({t for titles in TITLES.values() for t in titles}):
        yield (f"List every {title} with the name of their department.",
               "SELECT e.name, d.name AS department\nFROM employees AS e\nJOIN departments AS d ON d.id = e.department_id\n"
               f"WHERE e.title = '{title}'\nORDER BY e.name;", EMP)


def _department_salary_stats():
    for d in DEPTS:
        yield (f"Give the lowest, highest and average salary in the {d} department.",
               "SELECT MIN(e.salary) AS lowest, MAX(e.salary) AS highest, ROUND(AVG(e.salary), 2) AS average\n"
               "FROM employees AS e\nJOIN departments AS d ON d.id = e.department_id\n"
               f"WHERE d.name = '{d}';", EMP)


def _signups_per_country():
    for y in YEARS:
        yield (f"How many customers signed up in {y}, per country?",
               "SELECT country, COUNT(*) AS signups\nFROM customers\n"
               f"WHERE strftime('%Y', signup_date) = '{y}'\nGROUP BY country\nORDER BY signups DESC, country;",
               ("customers",))


def _status_count_by_country():
    for status, country in itertools.product(("pending", "shipped", "cancelled"), COUNTRIES):
        yield (f"How many orders from customers in {country} currently have the status '{status}'?",
               "SELECT COUNT(*) AS orders\nFROM orders AS o\nJOIN customers AS c ON c.id = o.customer_id\n"
               f"WHERE c.country = '{country}' AND o.status = '{status}';", ("customers", "orders"))


def _product_revenue_in_category():
    for cat in CATEGORIES:
        yield (f"What is the total revenue of each {cat} product over all non-cancelled orders?",
               "SELECT p.name, ROUND(SUM(oi.quantity * oi.unit_price), 2) AS revenue\nFROM products AS p\n"
               "JOIN order_items AS oi ON oi.product_id = p.id\nJOIN orders AS o ON o.id = oi.order_id\n"
               f"WHERE p.category = '{cat}' AND o.status <> 'cancelled'\nGROUP BY p.id, p.name\nORDER BY revenue DESC;",
               ("orders", "order_items", "products"))


def _orders_with_many_products():
    for n in (3, 4):
        yield (f"Which orders contain at least {n} different products?",
               "SELECT order_id, COUNT(DISTINCT product_id) AS products\nFROM order_items\nGROUP BY order_id\n"
               f"HAVING COUNT(DISTINCT product_id) >= {n}\nORDER BY order_id;", ("order_items",))


def _hired_before_manager():
    yield ("Which employees were hired before their own manager?",
           "SELECT e.name, e.hire_date, m.name AS manager, m.hire_date AS manager_hire_date\nFROM employees AS e\n"
           "JOIN employees AS m ON m.id = e.manager_id\nWHERE e.hire_date < m.hire_date\nORDER BY e.hire_date;",
           ("employees",))


def _price_extremes():
    for cat, (word, order) in itertools.product(CATEGORIES, (("cheapest", "ASC"), ("most expensive", "DESC"))):
        yield (f"Show the three {word} {cat} products.",
               f"SELECT name, price\nFROM products\nWHERE category = '{cat}'\nORDER BY price {order}\nLIMIT 3;",
               ("products",))


def _quarterly_revenue():
    for y in YEARS:
        yield (f"Break down {y} revenue from delivered orders by quarter.",
               "SELECT (CAST(strftime('%m', o.order_date) AS INTEGER) + 2) / 3 AS quarter,\n"
               "       ROUND(SUM(oi.quantity * oi.unit_price), 2) AS revenue\nFROM orders AS o\n"
               "JOIN order_items AS oi ON oi.order_id = o.id\n"
               f"WHERE strftime('%Y', o.order_date) = '{y}' AND o.status = 'delivered'\nGROUP BY quarter\nORDER BY quarter;",
               ("orders", "order_items"))


def _first_order_in_city():
    for city, _ in CITIES:
        yield (f"For customers in {city}, show each customer's first order date using ROW_NUMBER().",
               "SELECT name, order_date\nFROM (\n  SELECT c.name, o.order_date,\n"
               "         ROW_NUMBER() OVER (PARTITION BY c.id ORDER BY o.order_date) AS n\n"
               "  FROM customers AS c\n  JOIN orders AS o ON o.customer_id = c.id\n"
               f"  WHERE c.city = '{city}'\n) AS numbered\nWHERE n = 1\nORDER BY order_date;", ("customers", "orders"))


TEMPLATES: dict[str, Template] = {
    f.__name__.lstrip("_"): f for f in (
        _employees_in_department, _headcount_over, _average_salary_by_location, _top_earners, _hired_in_year,
        _salary_above, _direct_reports, _above_department_average, _second_highest_salary, _top_per_department,
        _customers_in_city, _customers_without_orders, _orders_per_customer, _revenue_by_category, _orders_per_month,
        _products_in_price_range, _best_seller_in_category, _big_spenders, _revenue_by_sales_rep,
        _never_ordered_products, _running_revenue, _payroll_vs_budget, _latest_order_per_customer,
        _cancellation_rate, _cities_buying_category, _signup_year_buyers, _year_over_year, _average_order_value,
        _hired_since_in_department, _employees_with_title, _department_salary_stats, _signups_per_country,
        _status_count_by_country, _product_revenue_in_category, _orders_with_many_products, _hired_before_manager,
        _price_extremes, _quarterly_revenue, _first_order_in_city)
}


def sql_tasks() -> list[SqlTask]:
    """Every template instance whose answer runs on the sample database and returns at least one row."""
    conn = build_database()
    tasks = []
    for name, template in TEMPLATES.items():
        for question, sql, tables in template():
            if conn.execute(sql).fetchall():  # raises sqlite3.Error on a broken answer
                tasks.append(SqlTask(name, question, sql, tables))
    return tasks


def prompt_for(task: SqlTask) -> str:
    return f"Tables:\n{schema_lines(task.tables)}\n\nWrite an SQLite query: {task.question}"
